// A minimal chat page: the AI SDK's useChat on @holdfast/client/ai-sdk's transport.
// ?task= names the chat (the task), ?key= the API key (a test page: a real one
// holds no key, see the client's README), ?send= a message sent on load; without
// it the page resumes the task's running turn, as after a reload.
import { useChat } from "@ai-sdk/react";
import { HoldfastClient } from "@holdfast/client";
import { HoldfastChatTransport } from "@holdfast/client/ai-sdk";
import { useEffect, useRef } from "react";
import { createRoot } from "react-dom/client";

const params = new URLSearchParams(location.search);
const client = new HoldfastClient({ baseUrl: location.origin, apiKey: params.get("key") });
const transport = new HoldfastChatTransport({ client });

function Chat({ id, send }) {
  const { messages, sendMessage, status } = useChat({ id, transport, resume: !send });
  const sent = useRef(false);
  useEffect(() => {
    if (send && !sent.current) {
      sent.current = true;
      sendMessage({ text: send });
    }
  }, [send, sendMessage]);
  return (
    <main>
      <p id="status">{status}</p>
      {messages.map((message) => (
        <div key={message.id} className={`message ${message.role}`}>
          {message.parts.map((part, i) => (part.type === "text" ? <span key={i}>{part.text}</span> : null))}
        </div>
      ))}
    </main>
  );
}

createRoot(document.getElementById("root")).render(<Chat id={params.get("task")} send={params.get("send")} />);
