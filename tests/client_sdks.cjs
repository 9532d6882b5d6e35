// The server through OpenAI's and Anthropic's official JavaScript SDKs
// (run by client_sdks_test.sh): completions, chat and messages, whole and
// streamed, log-probabilities, n, stop sequences, token counting, and the
// SDKs' own error types for a bad request. Greedy decoding makes the routes
// comparable: the same turns give the same text on chat and messages. The
// second server's model was trained to answer TOOL_REQUEST with a call in
// DeepSeek-V4.1's format: both SDKs must receive it as their tool call,
// whole and streamed, and send its result back.
"use strict";
const fs = require("fs");
const path = require("path");
const sdk = (name) => require(path.join(process.env.SDK_DIR, name));
const OpenAI = sdk("openai").default;
const Anthropic = sdk("@anthropic-ai/sdk").default;

const base = process.argv[2];
let failed = 0;
function check(ok, what) {
  console.log(`${ok ? "ok" : "FAIL"}: ${what}`);
  if (!ok) failed++;
}
async function refused(promise) {
  try {
    await promise;
    return null;
  } catch (e) {
    return e;
  }
}

async function openai() {
  const client = new OpenAI({ baseURL: `${base}/v1`, apiKey: "none", maxRetries: 0, timeout: 120000 });
  const models = await client.models.list();
  check(models.data.length === 1 && models.data[0].id === "tiny", `models.list: ${JSON.stringify(models.data)}`);

  const req = { model: "tiny", prompt: "hello world", max_tokens: 6, temperature: 0 };
  const whole = await client.completions.create(req);
  check(typeof whole.choices[0].text === "string" && whole.usage.completion_tokens <= 6,
        `completions.create: ${JSON.stringify(whole.choices[0].text)}`);
  let text = "";
  for await (const chunk of await client.completions.create({ ...req, stream: true })) text += chunk.choices[0]?.text ?? "";
  check(text === whole.choices[0].text, `a streamed completion has the same text (${JSON.stringify(text)})`);

  const echo = await client.completions.create({ model: "tiny", prompt: "hello world", max_tokens: 0, echo: true,
                                                 logprobs: 1 });
  const lp = echo.choices[0].logprobs;
  check(lp.token_logprobs[0] === null && lp.token_logprobs.slice(1).every((x) => typeof x === "number" && x <= 0),
        `echo with max_tokens 0 gives the prompt's logprobs: ${JSON.stringify(lp.token_logprobs)}`);

  const messages = [{ role: "user", content: "hello" }];
  const chat = await client.chat.completions.create({ model: "tiny", messages, max_tokens: 6, temperature: 0,
                                                      logprobs: true, top_logprobs: 2 });
  const c = chat.choices[0];
  check(c.message.role === "assistant" && typeof c.message.content === "string",
        `chat.completions.create: ${JSON.stringify(c.message)}`);
  check(c.logprobs.content.length === chat.usage.completion_tokens &&
          c.logprobs.content.every((t) => t.top_logprobs.length === 2 && t.logprob <= 0),
        "chat logprobs: one entry per token, each with its 2 most likely");
  text = "";
  const stream = await client.chat.completions.create({ model: "tiny", messages, max_tokens: 6, temperature: 0,
                                                        stream: true, stream_options: { include_usage: true } });
  let usage = null;
  for await (const chunk of stream) {
    text += chunk.choices[0]?.delta?.content ?? "";
    if (chunk.usage) usage = chunk.usage;
  }
  check(text === c.message.content, `a streamed chat has the same text (${JSON.stringify(text)})`);
  check(usage && usage.completion_tokens === chat.usage.completion_tokens, `the stream's usage: ${JSON.stringify(usage)}`);

  const n = await client.chat.completions.create({ model: "tiny", messages, max_tokens: 4, n: 3, seed: 7 });
  check(n.choices.length === 3 && n.choices.every((x, i) => x.index === i), "n: 3 choices");

  // Tools as the SDK sends them: rendered into the prompt (the tiny model
  // rarely calls one; tests/server_tools_test.cc scripts the calls).
  const tools = [{ type: "function", function: { name: "get_weather", description: "Weather of a city",
                                                 parameters: { type: "object", properties: { city: { type: "string" } } } } }];
  const withTools = await client.chat.completions.create({ model: "tiny", messages, max_tokens: 4, temperature: 0,
                                                           tools, tool_choice: "auto" });
  check(withTools.usage.prompt_tokens > chat.usage.prompt_tokens && withTools.choices[0].message.role === "assistant",
        `tools go into the prompt (${withTools.usage.prompt_tokens} tokens against ${chat.usage.prompt_tokens})`);

  const bad = await refused(client.chat.completions.create({ model: "tiny", messages, max_tokens: "six" }));
  check(bad instanceof OpenAI.BadRequestError && bad.status === 400 && bad.param === "max_tokens",
        `a bad field is the SDK's BadRequestError naming it: ${bad && bad.message}`);
  return c.message.content;
}

async function anthropic(chatText) {
  const client = new Anthropic({ baseURL: base, apiKey: "none", maxRetries: 0, timeout: 120000 });
  const req = { model: "tiny", max_tokens: 6, temperature: 0, messages: [{ role: "user", content: "hello" }] };
  const msg = await client.messages.create(req);
  check(msg.type === "message" && msg.role === "assistant" && msg.content[0].type === "text",
        `messages.create: ${JSON.stringify(msg.content)}`);
  check(msg.content[0].text === chatText, "messages and chat give the same text for the same turn");
  check(["end_turn", "max_tokens"].includes(msg.stop_reason) && msg.usage.output_tokens <= 6,
        `stop_reason ${msg.stop_reason}, usage ${JSON.stringify(msg.usage)}`);

  const events = [];
  const stream = client.messages.stream(req);
  stream.on("streamEvent", (e) => events.push(e.type));
  const final = await stream.finalMessage();
  check(final.content[0].text === msg.content[0].text && final.stop_reason === msg.stop_reason,
        `messages.stream's final message is the same (${JSON.stringify(final.content)})`);
  check(events[0] === "message_start" && events[events.length - 1] === "message_stop" &&
          events.includes("content_block_delta") === (msg.content[0].text.length > 0),
        `the stream's events: ${events.join(" ")}`);

  const text = msg.content[0].text;
  if (text.length >= 2) {
    const stop = Array.from(text)[Math.floor(Array.from(text).length / 2)];
    const stopped = await client.messages.create({ ...req, stop_sequences: [stop] });
    check(stopped.stop_reason === "stop_sequence" && stopped.stop_sequence === stop &&
            stopped.content[0].text === text.slice(0, text.indexOf(stop)),
          `stop_sequences: ${JSON.stringify(stopped)}`);
  }
  const counted = await client.messages.countTokens({ model: "tiny", messages: req.messages });
  check(counted.input_tokens === msg.usage.input_tokens, `countTokens: ${JSON.stringify(counted)}`);

  const tools = [{ name: "get_weather", description: "Weather of a city",
                   input_schema: { type: "object", properties: { city: { type: "string" } } } }];
  const withTools = await client.messages.create({ ...req, max_tokens: 4, tools, tool_choice: { type: "auto" } });
  check(withTools.usage.input_tokens > msg.usage.input_tokens,
        `tools go into the prompt (${withTools.usage.input_tokens} tokens against ${msg.usage.input_tokens})`);
  // Thinking on: the answer opens with a thinking block (the tiny model
  // never closes its reasoning, so all it says is thought).
  const thought = await client.messages.create({ ...req, max_tokens: 1025, thinking: { type: "enabled", budget_tokens: 1024 },
                                                 stop_sequences: ["e"] });
  check(thought.content[0].type === "thinking" && typeof thought.content[0].thinking === "string",
        `thinking: ${JSON.stringify(thought.content.map((b) => b.type))}`);

  const bad = await refused(client.messages.create({ ...req, temperature: 1.5 }));
  check(bad instanceof Anthropic.BadRequestError && bad.status === 400 &&
          bad.error?.error?.type === "invalid_request_error" && /temperature/.test(bad.message),
        `a bad field is the SDK's BadRequestError: ${bad && bad.message}`);
}

async function toolCalls(base2) {
  const req = JSON.parse(fs.readFileSync(process.env.TOOL_REQUEST, "utf8"));
  const client = new OpenAI({ baseURL: `${base2}/v1`, apiKey: "none", maxRetries: 0, timeout: 120000 });
  const ask = { model: "caller", messages: req.messages, tools: req.tools, max_tokens: 200, temperature: 0 };
  const r = await client.chat.completions.create(ask);
  const m = r.choices[0].message;
  check(r.choices[0].finish_reason === "tool_calls" && m.content === null && m.tool_calls?.length === 1,
        `the model's call is OpenAI's tool_calls: ${JSON.stringify(r.choices[0])}`);
  const ids = JSON.parse(fs.readFileSync(process.env.PROMPT_IDS, "utf8"));
  check(r.usage.prompt_tokens === ids.length,
        `\`deepseek chat-template --ids\` gave the server's prompt: ${ids.length} ids, ${r.usage.prompt_tokens} used`);
  const call = m.tool_calls?.[0];
  check(call?.type === "function" && call.function.name === "get_weather" && typeof call.id === "string" &&
          JSON.stringify(JSON.parse(call.function.arguments)) === JSON.stringify({ city: "Paris" }),
        `get_weather({"city": "Paris"}): ${JSON.stringify(call)}`);
  const deltas = {};
  let finish = null;
  for await (const chunk of await client.chat.completions.create({ ...ask, stream: true })) {
    for (const d of chunk.choices[0]?.delta?.tool_calls ?? []) {
      const t = (deltas[d.index] ??= { name: "", arguments: "" });
      t.name += d.function?.name ?? "";
      t.arguments += d.function?.arguments ?? "";
    }
    finish = chunk.choices[0]?.finish_reason ?? finish;
  }
  check(finish === "tool_calls" && Object.keys(deltas).length === 1 && deltas[0].name === "get_weather" &&
          deltas[0].arguments === call?.function.arguments,
        `streamed, the call arrives as tool_calls deltas: ${JSON.stringify(deltas)}`);
  const after = await client.chat.completions.create({
    ...ask, max_tokens: 4,
    messages: [...req.messages, m, { role: "tool", tool_call_id: call?.id, content: "sunny, 21 C" }] });
  check(after.choices[0].message.role === "assistant" && after.usage.prompt_tokens > r.usage.prompt_tokens,
        `the call's result goes back as a tool message (${after.usage.prompt_tokens} prompt tokens)`);

  const anthropic = new Anthropic({ baseURL: base2, apiKey: "none", maxRetries: 0, timeout: 120000 });
  const tools = req.tools.map((t) => ({ name: t.function.name, description: t.function.description,
                                        input_schema: t.function.parameters }));
  const mreq = { model: "caller", max_tokens: 200, temperature: 0, messages: req.messages, tools };
  const counted = await anthropic.messages.countTokens({ model: "caller", messages: req.messages, tools });
  check(counted.input_tokens === r.usage.prompt_tokens,
        `the Messages API's prompt is as long as the chat route's (${counted.input_tokens} tokens against ${r.usage.prompt_tokens})`);
  const msg = await anthropic.messages.create(mreq);
  const use = msg.content.find((b) => b.type === "tool_use");
  check(msg.stop_reason === "tool_use" && use?.name === "get_weather" &&
          JSON.stringify(use.input) === JSON.stringify({ city: "Paris" }),
        `the model's call is Anthropic's tool_use block: ${JSON.stringify(msg.content)} (${msg.stop_reason})`);
  const final = await anthropic.messages.stream(mreq).finalMessage();
  const streamed = final.content.find((b) => b.type === "tool_use");
  check(final.content.length === msg.content.length && final.stop_reason === "tool_use" &&
          streamed?.name === use?.name && JSON.stringify(streamed?.input) === JSON.stringify(use?.input),
        `messages.stream gives the same tool_use: ${JSON.stringify(final.content)}`);
  const back = await anthropic.messages.create({ ...mreq, max_tokens: 4, messages: [...req.messages,
    { role: "assistant", content: msg.content },
    { role: "user", content: [{ type: "tool_result", tool_use_id: use?.id, content: "sunny, 21 C" }] }] });
  check(back.type === "message" && back.usage.input_tokens > msg.usage.input_tokens,
        `the tool_result goes back (${back.usage.input_tokens} input tokens)`);
}

(async () => {
  const chatText = await openai();
  await anthropic(chatText);
  await toolCalls(process.argv[3]);
  console.log(failed ? `${failed} checks failed` : "every check passed");
  process.exit(failed ? 1 : 0);
})().catch((e) => {
  console.log(`FAIL: ${e.stack || e}`);
  process.exit(1);
});
