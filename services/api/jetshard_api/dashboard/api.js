// Requests to this API, with the key the user gave (kept in this browser's localStorage) when there is one.

const KEY_ITEM = "jetshard.apiKey";

export function apiKey() {
  return localStorage.getItem(KEY_ITEM) ?? "";
}

export function setApiKey(key) {
  if (key) localStorage.setItem(KEY_ITEM, key);
  else localStorage.removeItem(KEY_ITEM);
}

export function apiFetch(path, init = {}) {
  const headers = new Headers(init.headers);
  const key = apiKey();
  if (key) headers.set("Authorization", `Bearer ${key}`);
  return fetch(path, { ...init, headers });
}

// The message of an OpenAI-shaped error body, or the status line when the body is something else.
export async function errorMessage(response) {
  try {
    const body = await response.json();
    if (body?.error?.message) return body.error.message;
  } catch {
    // not JSON: fall through to the status line
  }
  return `${response.status} ${response.statusText}`.trim();
}
