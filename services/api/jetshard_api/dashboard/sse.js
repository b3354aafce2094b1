// Server-sent events read from a fetch body, so requests can carry the API key (EventSource sends no headers).

// Calls onMessage({event, data}) for each message of `response`'s text/event-stream body, until it ends, and
// onComment(text) for each comment (the API's keep-alives say in them what an answer waits for).
export async function readEvents(response, onMessage, onComment = () => {}) {
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffered = "";
  let event = "message";
  let data = [];
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    const lines = (buffered + value).split(/\r?\n/);
    buffered = lines.pop();
    for (const line of lines) {
      if (line === "") {
        if (data.length) onMessage({ event, data: data.join("\n") });
        event = "message";
        data = [];
      } else if (line.startsWith(":")) {
        onComment(line.slice(1).replace(/^ /, ""));
      } else {
        const colon = line.indexOf(":");
        const field = colon < 0 ? line : line.slice(0, colon);
        const text = colon < 0 ? "" : line.slice(colon + 1).replace(/^ /, "");
        if (field === "event") event = text;
        else if (field === "data") data.push(text);
      }
    }
  }
}
