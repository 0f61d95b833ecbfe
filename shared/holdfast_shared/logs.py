"""Process-wide logging set-up, the same format in every service."""

from __future__ import annotations

import logging


def configure_logging(level: str, service: str) -> None:
    logging.basicConfig(
        level=level.upper(),
        format=f"%(asctime)s %(levelname)s {service} %(name)s: %(message)s",
    )
