"""The tool-runner's MCP clients: a tenant's Asset Directory servers, called with
the official ``mcp`` SDK — sessions kept per task (``sessions.py``), stdio
servers in the sandbox and HTTP ones with their stored credentials
(``transports.py``), results redacted of those credentials (``outcomes.py``).
"""

from holdfast_tool_runner.connectors.calls import Connectors
from holdfast_tool_runner.connectors.sessions import SessionKey, Sessions

__all__ = ["Connectors", "SessionKey", "Sessions"]
