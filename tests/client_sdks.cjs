// The server through OpenAI's and Anthropic's official JavaScript SDKs
// (run by client_sdks_test.sh): completions, chat and messages, whole and
// streamed, log-probabilities, n, stop sequences, token counting, and the
// SDKs' own error types for a bad request. Greedy decoding makes the routes
// comparable: the same turns give the same text on chat and messages.
"use strict";
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

(async () => {
  const chatText = await openai();
  await anthropic(chatText);
  console.log(failed ? `${failed} checks failed` : "every check passed");
  process.exit(failed ? 1 : 0);
})().catch((e) => {
  console.log(`FAIL: ${e.stack || e}`);
  process.exit(1);
});
