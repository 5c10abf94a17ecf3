// The npm `ollama` client's calls against a Cortex gateway, for tests/integration/clients/test_ollama_js.py.
// Usage: node ollama_client.cjs MODULE_DIR HOST API_KEY ADMIN_KEY — prints one JSON object of what the client got
// (pulling onto the fleet takes the admin key).
const { Ollama } = require(process.argv[2]);

const client = new Ollama({ host: process.argv[3], headers: { Authorization: `Bearer ${process.argv[4]}` } });
const admin = new Ollama({ host: process.argv[3], headers: { Authorization: `Bearer ${process.argv[5]}` } });
const hi = [{ role: 'user', content: 'Hello there' }];
const greedy = { temperature: 0, num_predict: 8 };
const bash = { type: 'function', function: { name: 'Bash', description: 'Run a shell command', parameters: {
  type: 'object', properties: { command: { type: 'string' } }, required: ['command'] } } };
const askFiles = [{ role: 'user', content: 'What files are here?' }];
const schema = { type: 'object', properties: { ok: { type: 'boolean' } }, required: ['ok'], additionalProperties: false };

async function collect(stream, pick) {
  const parts = [];
  for await (const part of stream) parts.push(part);
  return { text: parts.map(pick).join(''), last: parts[parts.length - 1] };
}

async function refused(call) {
  try {
    await call();
    return null;
  } catch (error) {
    return { status: error.status_code, error: error.error };
  }
}

async function main() {
  const chat = await client.chat({ model: 'tiny', messages: hi, options: greedy });
  const chatStream = await collect(await client.chat({ model: 'tiny:latest', messages: hi, options: greedy, stream: true }),
    (part) => part.message.content);
  const generate = await client.generate({ model: 'default', prompt: 'Hello there', options: greedy });
  const generateStream = await collect(await client.generate({ model: 'tiny', prompt: 'Hello there', options: greedy, stream: true }),
    (part) => part.response);
  const call = await client.chat({ model: 'scripted', messages: askFiles, tools: [bash] });
  const answer = await client.chat({ model: 'scripted', tools: [bash], messages: [...askFiles, call.message,
    { role: 'tool', content: 'notes.txt', tool_name: 'Bash' }] });
  const format = await client.chat({ model: 'tiny', messages: hi, format: schema, options: { temperature: 0, num_predict: 40 } });
  const report = {
    version: (await client.version()).version,
    chat, chatStream, generate, generateStream,
    toolCalls: call.message.tool_calls, afterTool: answer.message.content,
    format: format.message.content,
    list: (await client.list()).models.map((m) => m.model),
    show: await client.show({ model: 'tiny' }),
    ps: (await client.ps()).models,
    pull: await admin.pull({ model: 'tiny' }),
    pullRefused: await refused(() => client.pull({ model: 'tiny' })),
    embed: await client.embed({ model: 'embed', input: ['Hello there', 'The sea'] }),
    unknown: await refused(() => client.chat({ model: 'no-such-model', messages: hi })),
    noKey: await refused(() => new Ollama({ host: process.argv[3] }).list()),
  };
  process.stdout.write(JSON.stringify(report));
}

main().catch((error) => {
  console.error(error);
  process.exit(1);
});
