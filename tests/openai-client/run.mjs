// Drives a live pdq gateway with the official OpenAI Node client, as a user
// would. PDQ_URL is the gateway's base URL; PDQ_MODEL the model. Prints one
// line per check and exits 1 if any fails.
import OpenAI, { NotFoundError, BadRequestError } from "openai";

const baseURL = `${process.env.PDQ_URL}/v1`;
const model = process.env.PDQ_MODEL ?? "pdq-sim";
const client = new OpenAI({ baseURL, apiKey: "unused", maxRetries: 0, timeout: 30_000 });
const prompt = "Explain in two sentences why prefill and decode run on separate GPUs.";

let failed = 0;
async function check(name, fn) {
  try {
    const detail = await fn();
    console.log(`ok   ${name}: ${detail}`);
  } catch (err) {
    failed++;
    console.log(`FAIL ${name}: ${err?.stack ?? err}`);
  }
}
function assert(cond, msg) {
  if (!cond) throw new Error(msg);
}
const words = (s) => s.trim().split(/\s+/).filter(Boolean).length;

await check("chat, streaming", async () => {
  const stream = await client.chat.completions.create({
    model,
    messages: [{ role: "user", content: prompt }],
    max_completion_tokens: 12,
    ignore_eos: true,
    stream: true,
    stream_options: { include_usage: true },
  });
  let text = "", chunks = 0, finish = null, usage = null, role = null, id = null;
  for await (const chunk of stream) {
    chunks++;
    id ??= chunk.id;
    assert(chunk.id === id, `chunk id ${chunk.id} != ${id}`);
    if (chunk.usage) usage = chunk.usage;
    const choice = chunk.choices[0];
    if (!choice) continue;
    role ??= choice.delta.role ?? null;
    text += choice.delta.content ?? "";
    finish = choice.finish_reason ?? finish;
  }
  assert(role === "assistant", `role ${role}`);
  assert(finish === "length", `finish_reason ${finish}`);
  assert(usage?.completion_tokens === 12, `usage ${JSON.stringify(usage)}`);
  assert(words(text) === 12, `text "${text}" is not 12 words`);
  assert(id.startsWith("chatcmpl-"), `id ${id}`);
  return `${chunks} chunks, "${text}"`;
});

await check("chat, non-streaming", async () => {
  const res = await client.chat.completions
    .create({ model, messages: [{ role: "user", content: prompt }], max_tokens: 7, ignore_eos: true }, { headers: { "X-Request-Id": `openai-node-${Date.now()}` } })
    .withResponse();
  const c = res.data;
  assert(c.object === "chat.completion", `object ${c.object}`);
  assert(c.choices[0].message.role === "assistant", "role");
  assert(words(c.choices[0].message.content) === 7, `content "${c.choices[0].message.content}"`);
  assert(c.usage.completion_tokens === 7 && c.usage.total_tokens === c.usage.prompt_tokens + 7, `usage ${JSON.stringify(c.usage)}`);
  const rid = res.response.headers.get("x-request-id");
  assert(c.id === `chatcmpl-${rid}`, `id ${c.id} does not carry X-Request-Id ${rid}`);
  return `"${c.choices[0].message.content}"`;
});

await check("completions", async () => {
  const c = await client.completions.create({ model, prompt, max_tokens: 5, ignore_eos: true });
  assert(c.object === "text_completion", `object ${c.object}`);
  assert(words(c.choices[0].text) === 5, `text "${c.choices[0].text}"`);
  assert(c.usage.completion_tokens === 5, `usage ${JSON.stringify(c.usage)}`);
  const stream = await client.completions.create({ model, prompt, max_tokens: 4, ignore_eos: true, stream: true });
  let text = "";
  for await (const chunk of stream) text += chunk.choices[0]?.text ?? "";
  assert(text === c.choices[0].text.split(" ").slice(0, 4).join(" "), `streamed "${text}" vs "${c.choices[0].text}"`);
  return `"${c.choices[0].text}", streamed "${text}"`;
});

await check("chat with an image part", async () => {
  const image = "data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8BQDwAEhQGAhKmMIQAAAABJRU5ErkJggg==";
  const ask = (url) => client.chat.completions.create({
    model, max_tokens: 6, ignore_eos: true,
    messages: [{ role: "user", content: [{ type: "text", text: prompt }, { type: "image_url", image_url: { url } }] }],
  });
  const [a, b] = [await ask(image), await ask(image.replace("Jggg", "Jhhh"))];
  assert(words(a.choices[0].message.content) === 6, `content "${a.choices[0].message.content}"`);
  // The image reaches the engines: another image, another answer, and
  // the image's tokens count in the prompt.
  assert(a.choices[0].message.content !== b.choices[0].message.content, "two images gave one answer");
  const text = await client.chat.completions.create({ model, max_tokens: 1, messages: [{ role: "user", content: prompt }] });
  assert(a.usage.prompt_tokens > text.usage.prompt_tokens, `prompt tokens ${a.usage.prompt_tokens} with the image, ${text.usage.prompt_tokens} without`);
  return `"${a.choices[0].message.content}", ${a.usage.prompt_tokens} prompt tokens`;
});

await check("LoRA adapter by name", async () => {
  const lora = process.env.PDQ_LORA;
  assert(lora, "PDQ_LORA is not set");
  const models = await client.models.list();
  const card = models.data.find((m) => m.id === lora);
  assert(card && card.parent === model, `adapter card ${JSON.stringify(card)}`);
  const c = await client.completions.create({ model: lora, prompt, max_tokens: 5, ignore_eos: true });
  const base = await client.completions.create({ model, prompt, max_tokens: 5, ignore_eos: true });
  assert(c.model === lora, `model ${c.model}`);
  assert(c.choices[0].text !== base.choices[0].text, "the adapter answered as the base model");
  return `"${c.choices[0].text}"`;
});

await check("completions, batched prompts", async () => {
  const prompts = [prompt, "Say hello.", `${prompt} Then stop.`];
  const c = await client.completions.create({ model, prompt: prompts, max_tokens: 3, ignore_eos: true }, { headers: { "X-Request-Id": `batch-${Date.now()}` } }).withResponse();
  const r = c.data;
  assert(r.choices.length === 3, `${r.choices.length} choices`);
  r.choices.forEach((ch, i) => assert(ch.index === i && words(ch.text) === 3, `choice ${i}: ${JSON.stringify(ch)}`));
  assert(r.usage.completion_tokens === 9, `usage ${JSON.stringify(r.usage)}`);
  assert(r.id === `cmpl-${c.response.headers.get("x-request-id")}`, `id ${r.id}`);
  const stream = await client.completions.create({ model, prompt: prompts, max_tokens: 3, ignore_eos: true, stream: true, stream_options: { include_usage: true } });
  const texts = ["", "", ""];
  let usage = null;
  for await (const chunk of stream) {
    for (const ch of chunk.choices) texts[ch.index] += ch.text;
    if (chunk.usage) usage = chunk.usage;
  }
  texts.forEach((t, i) => assert(t === r.choices[i].text, `streamed choice ${i} "${t}" vs "${r.choices[i].text}"`));
  assert(usage?.completion_tokens === 9, `streamed usage ${JSON.stringify(usage)}`);
  return r.choices.map((ch) => `"${ch.text}"`).join(", ");
});

await check("error: unknown model", async () => {
  try {
    await client.chat.completions.create({ model: "no-such-model", messages: [{ role: "user", content: "hi" }] });
  } catch (err) {
    assert(err instanceof NotFoundError, `got ${err?.constructor?.name}: ${err}`);
    assert(err.status === 404 && /does not exist/.test(err.message), `status ${err.status}, message ${err.message}`);
    return `${err.constructor.name} ${err.status}: ${err.message}`;
  }
  throw new Error("no error for an unknown model");
});

await check("any printable request id", async () => {
  const id = "req.1:abc def";
  const { data, response } = await client.completions
    .create({ model, prompt: "x", max_tokens: 1 }, { headers: { "X-Request-Id": id } })
    .withResponse();
  assert(response.headers.get("x-request-id") === id, `echoed ${response.headers.get("x-request-id")}`);
  assert(data.id === `cmpl-${id}`, `response id ${data.id}`);
  return `${data.id}`;
});

await check("error: bad request id", async () => {
  try {
    // Any printable id up to 256 characters is taken, as vLLM takes any.
    await client.completions.create({ model, prompt: "x", max_tokens: 1 }, { headers: { "X-Request-Id": "x".repeat(257) } });
  } catch (err) {
    assert(err instanceof BadRequestError && err.status === 400, `got ${err?.constructor?.name} ${err?.status}`);
    return `${err.constructor.name} ${err.status}`;
  }
  throw new Error("no error for an X-Request-Id of 257 characters");
});

process.exit(failed ? 1 : 0);
