// Times Hugging Face's tokenizers (node binding, Rust core) on the benchmark
// corpus, one thread: run with RAYON_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false.
//   node bench/tokenizer/hf_bench.js TOKENIZER.json CORPUS.json [PASSES]
// Prints one JSON line: cold MB/s (first pass after loading), warm MB/s (best
// later pass), the token count and a hash of all ids (to check that both
// tokenizers produced the same ids).
'use strict';
const path = require('path');
const fs = require('fs');
const {Tokenizer} = require(path.join(__dirname, '..', '..', '.cache', 'npm', 'node_modules', 'tokenizers'));

async function main() {
  const [tokPath, corpusPath, passesArg] = process.argv.slice(2);
  const docs = JSON.parse(fs.readFileSync(corpusPath, 'utf8'));
  const bytes = docs.reduce((s, d) => s + Buffer.byteLength(d), 0);
  const passes = Number(passesArg || 3);
  const tok = Tokenizer.fromFile(tokPath);
  const opts = {addSpecialTokens: false};
  const times = [];
  let encodings;
  for (let p = 0; p <= passes; p++) {
    const t0 = process.hrtime.bigint();
    encodings = await tok.encodeBatch(docs, opts);
    times.push(Number(process.hrtime.bigint() - t0) / 1e9);
  }
  let hash = 0, tokens = 0;
  for (const e of encodings) {
    for (const id of e.getIds()) hash = (Math.imul(hash, 1000003) + id + 1) >>> 0;
    tokens += e.getIds().length;
  }
  const mbs = (t) => bytes / 1e6 / t;
  console.log(JSON.stringify({
    bytes, tokens, hash, cold_mb_s: mbs(times[0]), warm_mb_s: mbs(Math.min(...times.slice(1))),
  }));
}
main().catch((e) => {
  console.error(e);
  process.exit(1);
});
