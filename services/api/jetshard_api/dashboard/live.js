// Following /view/stream: the whole view after every change and one line per event, reconnecting by itself.

import { apiFetch, errorMessage } from "./api.js";
import { readEvents } from "./sse.js";

const RETRY_MS = 2000;

// Calls onConnect() when a stream starts (it resends the latest events first), onView(view) and
// onEvent(line) as messages come, and onState(state, detail) with "live", "down" or "key" (401: a key is needed).
export function followView({ onConnect, onView, onEvent, onState }) {
  let current = null;
  let restarting = false;
  let wake = null;

  async function once() {
    current = new AbortController();
    const response = await apiFetch("/view/stream", {
      headers: { Accept: "text/event-stream" },
      signal: current.signal,
    });
    if (!response.ok) {
      onState(response.status === 401 ? "key" : "down", await errorMessage(response));
      return;
    }
    onConnect();
    await readEvents(response, ({ event, data }) => {
      if (event === "view") {
        onView(JSON.parse(data));
        onState("live");
      } else if (event === "event") {
        onEvent(JSON.parse(data));
      }
    });
    onState("down", "the API ended the stream");
  }

  async function loop() {
    for (;;) {
      try {
        await once();
      } catch (error) {
        if (!restarting) onState("down", String(error?.message ?? error));
      }
      if (!restarting) {
        await new Promise((resolve) => {
          wake = resolve;
          setTimeout(resolve, RETRY_MS);
        });
      }
      restarting = false;
    }
  }

  loop();
  return {
    // Start over at once, say with a new API key.
    restart() {
      restarting = true;
      current?.abort();
      wake?.();
    },
  };
}
