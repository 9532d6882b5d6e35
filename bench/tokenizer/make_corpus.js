// Writes a deterministic mixed corpus for the tokenizer benchmark as a JSON
// array of documents (2-8 KB each): English prose, source code, Chinese and
// Japanese text, and digit-heavy tables, in rotation.
//   node bench/tokenizer/make_corpus.js OUT.json [MEGABYTES]   (default 8)
'use strict';
const fs = require('fs');

let state = 0x9e3779b9;
function rand() {  // mulberry32: same stream on every machine
  state = (state + 0x6d2b79f5) >>> 0;
  let t = state;
  t = Math.imul(t ^ (t >>> 15), t | 1);
  t ^= t + Math.imul(t ^ (t >>> 7), t | 61);
  return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
}
const pick = (a) => a[Math.floor(rand() * a.length)];
const int = (lo, hi) => lo + Math.floor(rand() * (hi - lo + 1));

const WORDS = ('the of and to in is was for on that with as by at it from he his an be this which are or had not ' +
  'but were have their one all also has its new they first been after who more two her she other time would years ' +
  'into there may only state when up some world city most over such these between about government during many ' +
  'through university people school system could where both later under national however since known well before ' +
  'because while against number then three same large war used each including part several include history ' +
  'development language model training tokenizer attention expert routing memory latency throughput network ' +
  'research results significant performance architecture distributed parameters gradient optimizer evaluation')
  .split(' ');
const NAMES = ['Alice', 'Bob', 'London', 'Paris', 'DeepSeek', 'Python', 'Linux', 'March', 'Europe', 'Tokyo'];
const PUNCT = ['.', '.', '.', ',', ';', '!', '?', ':'];

function prose() {
  let out = '';
  while (out.length < int(2000, 6000)) {
    const n = int(6, 24);
    const w = [];
    for (let i = 0; i < n; i++) {
      let word = rand() < 0.08 ? pick(NAMES) : pick(WORDS);
      if (rand() < 0.05) word += "'s";
      if (rand() < 0.03) word = `"${word}"`;
      if (rand() < 0.06) word += ',';
      w.push(word);
    }
    let s = w.join(' ');
    s = s[0].toUpperCase() + s.slice(1) + pick(PUNCT);
    out += s + (rand() < 0.15 ? '\n\n' : ' ');
  }
  return out;
}

const IDENTS = ['x', 'y', 'value', 'count', 'result', 'buffer', 'index', 'tokens', 'weights', 'hidden_size', 'self',
  'config', 'data', 'i', 'j', 'total', 'logits', 'mask'];
function code() {
  let out = '';
  while (out.length < int(2000, 6000)) {
    if (rand() < 0.5) {
      out += `def ${pick(IDENTS)}_${pick(IDENTS)}(${pick(IDENTS)}, ${pick(IDENTS)}=${int(0, 99)}):\n`;
      for (let k = int(2, 8); k > 0; k--) {
        const ind = '    '.repeat(int(1, 3));
        out += pick([
          `${ind}${pick(IDENTS)} = ${pick(IDENTS)} + ${int(0, 1000)}\n`,
          `${ind}if ${pick(IDENTS)} > ${int(0, 50)}:\n`,
          `${ind}return ${pick(IDENTS)}[${pick(IDENTS)}:${int(1, 9)}]\n`,
          `${ind}# ${pick(WORDS)} ${pick(WORDS)} ${pick(WORDS)}\n`,
          `${ind}for ${pick(IDENTS)} in range(len(${pick(IDENTS)})):\n`,
          `${ind}print(f"{${pick(IDENTS)}=} {${pick(IDENTS)}:.3f}")\n`,
        ]);
      }
      out += '\n';
    } else {
      out += `static int ${pick(IDENTS)}(const float* ${pick(IDENTS)}, int64_t n) {\n`;
      for (let k = int(2, 8); k > 0; k--) {
        const ind = '\t'.repeat(int(1, 2));
        out += pick([
          `${ind}for (int64_t i = 0; i < n; ++i) ${pick(IDENTS)}[i] *= ${rand().toFixed(4)}f;\n`,
          `${ind}if (${pick(IDENTS)} == nullptr) return -${int(1, 9)};\n`,
          `${ind}${pick(IDENTS)} += ${pick(IDENTS)}[${int(0, 63)}] * 0x${int(0, 65535).toString(16)};\n`,
          `${ind}// ${pick(WORDS)} ${pick(WORDS)}\n`,
        ]);
      }
      out += '}\n\n';
    }
  }
  return out;
}

const CJK_PUNCT = ['，', '。', '、', '！', '？', '：', '「', '」'];
function cjk() {
  let out = '';
  while (out.length < int(800, 2500)) {
    const n = int(5, 30);
    for (let i = 0; i < n; i++) {
      const r = rand();
      if (r < 0.7) out += String.fromCodePoint(int(0x4e00, 0x7fff));  // common CJK ideographs
      else if (r < 0.85) out += String.fromCodePoint(int(0x3041, 0x3093));  // hiragana
      else if (r < 0.93) out += String.fromCodePoint(int(0x30a1, 0x30f3));  // katakana
      else out += pick(WORDS);
    }
    out += pick(CJK_PUNCT) + (rand() < 0.1 ? '\n' : '');
  }
  return out;
}

function digits() {
  let out = '';
  while (out.length < int(2000, 5000)) {
    out += `| ${int(2000, 2030)}-${String(int(1, 12)).padStart(2, '0')}-${String(int(1, 28)).padStart(2, '0')} ` +
           `| ${int(0, 99999999)} | ${(rand() * 1000).toFixed(int(1, 6))} | ${int(-500, 500)}% | ` +
           `${int(1e9, 9e9)}${int(1e9, 9e9)} |\n`;
  }
  return out;
}

const out = process.argv[2];
const megabytes = Number(process.argv[3] || 8);
const docs = [];
let bytes = 0;
const kinds = [prose, prose, code, cjk, digits];
for (let k = 0; bytes < megabytes * 1e6; k++) {
  const d = kinds[k % kinds.length]();
  docs.push(d);
  bytes += Buffer.byteLength(d);
}
fs.writeFileSync(out, JSON.stringify(docs));
console.error(`make_corpus: ${docs.length} documents, ${(bytes / 1e6).toFixed(2)} MB -> ${out}`);
