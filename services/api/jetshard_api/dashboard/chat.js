// The chat box: a conversation with one ready model, each answer streamed in as it is generated.

import { apiFetch, errorMessage } from "./api.js";
import { el } from "./dom.js";
import { readEvents } from "./sse.js";

const $ = (id) => document.getElementById(id);

let conversation = [];
let answering = null; // the AbortController of the answer coming in

function bubble(role, text = "") {
  const body = el("div", { className: "text" }, text);
  const message = el("div", { className: `message message-${role}` }, el("div", { className: "role" }, role), body);
  $("chat-log").append(message);
  return { message, body };
}

function scrollToEnd() {
  const log = $("chat-log");
  log.scrollTop = log.scrollHeight;
}

function setAnswering(controller) {
  answering = controller;
  $("chat-send").disabled = controller !== null || $("chat-model").value === "";
  $("chat-stop").disabled = controller === null;
}

function request(model) {
  const body = { model, messages: conversation, stream: true };
  const temperature = $("chat-temperature").value;
  const maxTokens = $("chat-max-tokens").value;
  if (temperature !== "") body.temperature = Number(temperature);
  if (maxTokens !== "") body.max_tokens = Number(maxTokens);
  return body;
}

async function ask(text) {
  const model = $("chat-model").value;
  conversation.push({ role: "user", content: text });
  const question = bubble("user", text);
  const answer = bubble("assistant");
  // Each piece is appended to one text node, so the answer grows in place and is never parsed as HTML.
  const streamed = document.createTextNode("");
  answer.body.append(streamed);
  // A thinking model's reasoning, apart from its answer: open while it comes in, folded once the answer starts.
  const thought = document.createTextNode("");
  const reasoning = el("details", { className: "reasoning", open: true }, el("summary", {}, "thinking"));
  reasoning.append(el("div", { className: "thought" }, thought));
  // What the answer waits for (queued, the prompt's progress), as the stream's keep-alives say, until it starts.
  const waiting = el("div", { className: "note waiting" });
  answer.message.classList.add("streaming");
  scrollToEnd();

  const controller = new AbortController();
  setAnswering(controller);
  let failure = null;
  try {
    const response = await apiFetch("/v1/chat/completions", {
      method: "POST",
      headers: { "Content-Type": "application/json", Accept: "text/event-stream" },
      body: JSON.stringify(request(model)),
      signal: controller.signal,
    });
    if (!response.ok) throw new Error(await errorMessage(response));
    await readEvents(
      response,
      ({ data }) => {
        if (data === "[DONE]") return;
        const chunk = JSON.parse(data);
        if (chunk.error) throw new Error(chunk.error.message);
        const delta = chunk.choices?.[0]?.delta;
        if (delta?.reasoning_content) {
          waiting.remove();
          if (!reasoning.isConnected) answer.body.before(reasoning);
          thought.appendData(delta.reasoning_content);
          scrollToEnd();
        }
        if (delta?.content) {
          waiting.remove();
          reasoning.open = false;
          streamed.appendData(delta.content);
          scrollToEnd();
        }
      },
      (comment) => {
        if (streamed.data || thought.data || !comment) return;
        waiting.textContent = comment;
        if (!waiting.isConnected) answer.message.append(waiting);
        scrollToEnd();
      },
    );
  } catch (error) {
    failure = error.name === "AbortError" ? "stopped" : String(error.message ?? error);
  } finally {
    controller.abort(); // closes the body of an answer that broke off
    waiting.remove();
    answer.message.classList.remove("streaming");
    setAnswering(null);
  }

  if (failure) answer.message.append(el("div", { className: failure === "stopped" ? "note" : "note error" }, failure));
  if (streamed.data || thought.data) {
    // The reasoning is not sent back, as with OpenAI's API: the model's chat template leaves past reasoning out.
    conversation.push({ role: "assistant", content: streamed.data });
  } else {
    // Nothing came back: the question is left out of the conversation, and shown so.
    conversation.pop();
    question.message.classList.add("dropped");
    answer.message.classList.add("dropped");
  }
  scrollToEnd();
}

// The models with a ready instance, offered in the picker (the current choice kept while it stays).
export function setReadyModels(modelIds) {
  const select = $("chat-model");
  const wanted = [...new Set(modelIds)].sort();
  const shown = [...select.options].map((o) => o.value).filter(Boolean);
  if (wanted.join("\n") !== shown.join("\n")) {
    const chosen = select.value;
    const options = wanted.map((id) => el("option", { value: id }, id));
    select.replaceChildren(...(options.length ? options : [el("option", { value: "" }, "no model is ready")]));
    if (wanted.includes(chosen)) select.value = chosen;
  }
  setAnswering(answering);
}

export function startChat() {
  const input = $("chat-input");
  $("chat-form").addEventListener("submit", (event) => {
    event.preventDefault();
    const text = input.value.trim();
    if (!text || answering || !$("chat-model").value) return;
    input.value = "";
    ask(text);
  });
  input.addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
      event.preventDefault();
      $("chat-form").requestSubmit();
    }
  });
  $("chat-stop").addEventListener("click", () => answering?.abort());
  $("chat-clear").addEventListener("click", () => {
    answering?.abort();
    conversation = [];
    $("chat-log").replaceChildren();
  });
  setAnswering(null);
}
