// Expected token ids from Hugging Face's own tokenizer library (the npm package
// `tokenizers`, Rust core), for the C++ tokenizer tests:
//   tests/data/tokenizer/deepseek_v3_expected.json  DeepSeek-V3's tokenizer.json
//   tests/data/tokenizer/tiny_expected.json         tests/data/tokenizer/tiny/tokenizer.json
//                                                   and two variants of it
//   tests/data/tokenizer/deepseek_v3_codepoints.json  how DeepSeek-V3's
//       pre-tokenizer cuts a few short texts around every code point (which
//       exposes each code point's regex classes: \s, \p{L}, \p{N}, ...)
// Each holds "encode": [{text, ids}] (ids without BOS: the bare tokenizer never
// adds one; "decoded" where decoding the ids does not give the text back) and "decode": [{ids, text}] (decode with skip_special_tokens=false,
// or true where "skip_special_tokens" says so).
//
// Regenerate, from the repository root:
//   bash scripts/fetch_tokenizer_assets.sh
//   node tests/reference/tokenizer/make_expected.js
// The assets are pinned in the fetch script, so the output is reproducible.
'use strict';
const fs = require('fs');
const path = require('path');
const crypto = require('crypto');

const ROOT = path.join(__dirname, '..', '..', '..');
const NPM = path.join(ROOT, '.cache', 'npm', 'node_modules');
const {Tokenizer} = require(path.join(NPM, 'tokenizers'));
const HF_VERSION = require(path.join(NPM, 'tokenizers', 'package.json')).version;
const DS_JSON = path.join(NPM, '@lenml', 'tokenizer-deepseek_v3', 'models', 'tokenizer.json');
const TINY_JSON = path.join(ROOT, 'tests', 'data', 'tokenizer', 'tiny', 'tokenizer.json');
const OUT_DIR = path.join(ROOT, 'tests', 'data', 'tokenizer');

// Texts that stress the split regexes, the added-token matcher and BPE.
const HARD_TEXTS = [
  '',
  ' ',
  '  ',
  '\t',
  '\n',
  'Hello world',
  'Hello, world! How are you doing today?',
  ' leading space',
  'trailing space ',
  'The quick brown fox jumps over the lazy dog.',
  // Contractions, lower and upper case.
  "it's don't we're I've I'm you'll he'd",
  "IT'S DON'T WE'RE I'VE I'M YOU'LL HE'D",
  "It'S dOn'T 'tis 'twas rock'n'roll",
  // Digits: runs are cut into groups of three.
  '1234567890123',
  '3.14159265358979 and 2,718,281 or 1e-10',
  'year 2024, ids 007 0x1F 1_000_000',
  '١٢٣٤٥ ४५६ 一二三 ½ ⅔ ² ③',
  // Whitespace runs of every kind.
  'a  b   c    d',
  'tabs\tand\t\ttabs',
  'new\nlines\n\nand\r\nCRLF\r\n',
  'spaces before newline   \n  indented',
  'nbsp\u00a0here and\u00a0\u00a0two',
  'em\u2003space and ideographic\u3000space',
  'next line\u0085char and \u0085\u0085 twice\u0085',
  'x\u0085\ny \u0085 z\u0085',
  'mongolian\u180evowel separator\u180e\u180e ',
  'zero\u200bwidth\u200b\u200bspace',
  'line\u2028separator\u2029paragraph',
  '   ',
  '\n\n\n',
  ' \t \n \u00a0 \u3000 ',
  // Code with indentation.
  'def f(x):\n    if x > 0:\n        return x * 2\n    return -x\n',
  'int main() {\n\tstd::vector<int> v{1, 2, 3};\n\tfor (auto& x : v) x += 1;\n\treturn 0;\n}\n',
  '    four spaces\n        eight spaces\n\t\ttwo tabs',
  'const s = `${a}+${b}`; // comment\n/* block */',
  '<div class="x">&amp;&lt;</div>',
  // Punctuation runs.
  '!!! ??? ... --- *** ###',
  '"quoted" \'single\' (parens) [brackets] {braces}',
  'a.b,c;d:e!f?g',
  '...\n!!!\n',
  '-->>==<<--',
  // CJK, Japanese, Korean.
  '你好，世界！今天天气很好。',
  '中文English混合text',
  'こんにちは世界。カタカナとひらがな。',
  '東京都渋谷区１２３ーＡＢＣ',
  '안녕하세요 세계! 한국어 텍스트입니다.',
  '漢字かなカナ한글abc123',
  // Emoji: ZWJ sequences, skin tones, flags, keycaps.
  '😀😃😄 👍🏽 👩‍💻 👨‍👩‍👧‍👦',
  '🏳️‍🌈 🇺🇸🇯🇵 1️⃣ #️⃣ ❤️',
  'emoji🙂inside🙂words',
  // Accents and combining marks.
  'café naïve résumé Ångström',
  'cafe\u0301 nai\u0308ve',
  'Z\u0351\u0324a\u0353\u0332l\u0341g\u0335o\u0347',
  'Ελληνικά Русский язык',
  // Right-to-left and Indic scripts.
  'مرحبا بالعالم',
  'שלום עולם',
  'नमस्ते दुनिया',
  'ภาษาไทย',
  // Special-token strings inside text.
  '<｜begin▁of▁sentence｜>',
  '<｜begin▁of▁sentence｜>Hello<｜end▁of▁sentence｜>',
  'before<｜end▁of▁sentence｜>after',
  '<｜User｜>hi<｜Assistant｜>hello<｜end▁of▁sentence｜>',
  '<｜begin▁of▁sentence｜ <｜end▁of▁sentence',
  '<think>\nreasoning\n</think>\n\nanswer',
  '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather',
  // Long words and runs (the heap path of BPE, past the cache).
  'a'.repeat(300),
  'hello'.repeat(40),
  ' '.repeat(100) + 'x',
  '9'.repeat(50),
  '=' .repeat(80),
  'supercalifragilisticexpialidocious antidisestablishmentarianism',
  // Control characters and odd code points.
  'ctrl\u0001\u0002\u001f\u007f end',
  'bom\ufeffhere',
  'replacement \ufffd char',
  'private \ue000 use',
  'astral 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𝟙𝟚𝟛 𐍈',
];

// Byte sequences whose decoding stresses the U+FFFD rules: [bytes..] become
// the ids of the byte-level symbols, other entries are token strings.
const DECODE_BYTES = [
  [[0xe4]],
  [[0xe4, 0xb8]],
  [[0xe4, 0xb8], 'a'],
  [[0xf0, 0x9f], 'a', [0x98]],
  [[0x80, 0x80]],
  [[0xc0, 0x80]],
  [[0xed, 0xa0, 0x80]],
  [[0xf5, 0x80]],
  [[0xf4, 0x90, 0x80, 0x80]],
  [[0xe0, 0x80, 0x80]],
  [[0xc3], [0xa9]],
  [[0xff, 0xfe, 0x41]],
];

function sha256(file) {
  return crypto.createHash('sha256').update(fs.readFileSync(file)).digest('hex');
}

async function encodeAll(tok, texts) {
  const out = [];
  for (const text of texts) {
    const e = await tok.encode(text, null, {addSpecialTokens: false});
    const ids = Array.from(e.getIds());
    const entry = {text, ids};
    // decode(encode(text)) is text except where an added token is made of
    // byte-level characters (the tiny tokenizer's "<Ġ>" decodes to "< >").
    const decoded = await tok.decode(ids, false);
    if (decoded !== text) entry.decoded = decoded;
    out.push(entry);
  }
  return out;
}

function byteChar(b) {
  const printable = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || b >= 174;
  if (printable) return String.fromCodePoint(b);
  let n = 0;
  for (let c = 0; c < b; c++) {
    if (!((c >= 33 && c <= 126) || (c >= 161 && c <= 172) || c >= 174)) n++;
  }
  return String.fromCodePoint(256 + n);
}

function idsOf(tok, parts) {
  const ids = [];
  for (const p of parts) {
    const toks = typeof p === 'string' ? [p] : p.map(byteChar);
    for (const t of toks) {
      const id = tok.tokenToId(t);
      if (id === null || id === undefined) throw new Error(`no id for ${t}`);
      ids.push(id);
    }
  }
  return ids;
}

async function decodeAll(tok, idLists, skip) {
  const out = [];
  for (const ids of idLists) {
    const entry = {ids, text: await tok.decode(ids, skip)};
    if (skip) entry.skip_special_tokens = true;
    out.push(entry);
  }
  return out;
}

function write(name, obj) {
  const file = path.join(OUT_DIR, name);
  // One case per line keeps diffs readable.
  const lines = [];
  lines.push('{');
  for (const [k, v] of Object.entries(obj)) {
    if (Array.isArray(v)) {
      lines.push(`  ${JSON.stringify(k)}: [`);
      v.forEach((c, i) => lines.push('    ' + JSON.stringify(c) + (i + 1 < v.length ? ',' : '')));
      lines.push('  ],');
    } else {
      lines.push(`  ${JSON.stringify(k)}: ${JSON.stringify(v)},`);
    }
  }
  lines[lines.length - 1] = lines[lines.length - 1].replace(/,$/, '');
  lines.push('}');
  fs.writeFileSync(file, lines.join('\n') + '\n');
  console.log(`wrote ${file}`);
}

// For every code point c, the byte lengths of the pieces that the
// pre-tokenizer makes of prefix + c + c + suffix for each context, joined into
// one signature string; stored run-length encoded over the code points.
const CODEPOINT_CONTEXTS = [['a', 'a'], ['\n', '\n'], ['.', '.'], ['', '']];

function codepointSignatures(tok) {
  const pt = tok.getPreTokenizer();
  const signatures = [];
  const index = new Map();
  const runs = [];
  let prev = -1;
  for (let c = 0; c < 0x110000; c++) {
    if (c >= 0xd800 && c < 0xe000) continue;
    const ch = String.fromCodePoint(c);
    const sig = CODEPOINT_CONTEXTS.map(([p, q]) =>
      pt.preTokenizeString(p + ch + ch + q).map(([piece]) => Buffer.byteLength(piece)).join(',')).join('|');
    if (!index.has(sig)) {
      index.set(sig, signatures.length);
      signatures.push(sig);
    }
    const k = index.get(sig);
    if (k !== prev) runs.push([c, k]);
    prev = k;
  }
  return {signatures, runs};
}

async function main() {
  // DeepSeek-V3.
  const ds = Tokenizer.fromFile(DS_JSON);
  const dsDecode = DECODE_BYTES.map((parts) => idsOf(ds, parts));
  dsDecode.push(idsOf(ds, ['<｜begin▁of▁sentence｜>', 'Hello', '<｜end▁of▁sentence｜>']));
  dsDecode.push(idsOf(ds, ['<｜User｜>', [0xe4, 0xbd], '<｜Assistant｜>']));
  write('deepseek_v3_expected.json', {
    generator: 'tests/reference/tokenizer/make_expected.js',
    tokenizers_version: HF_VERSION,
    tokenizer_json_sha256: sha256(DS_JSON),
    encode: await encodeAll(ds, HARD_TEXTS),
    decode: [...(await decodeAll(ds, dsDecode, false)), ...(await decodeAll(ds, dsDecode.slice(-2), true))],
  });

  const cp = codepointSignatures(ds);
  write('deepseek_v3_codepoints.json', {
    generator: 'tests/reference/tokenizer/make_expected.js',
    tokenizers_version: HF_VERSION,
    tokenizer_json_sha256: sha256(DS_JSON),
    contexts: CODEPOINT_CONTEXTS,
    signatures: cp.signatures,
    runs: cp.runs,
  });

  // The tiny tokenizer and its variants (built the same way by the C++ test).
  const tinyText = fs.readFileSync(TINY_JSON, 'utf8');
  const arrayMerges = JSON.parse(tinyText);
  arrayMerges.model.merges = arrayMerges.model.merges.map((m) => m.split(' '));
  const gpt2 = JSON.parse(tinyText);
  gpt2.pre_tokenizer = {type: 'ByteLevel', add_prefix_space: false, trim_offsets: true, use_regex: true};
  const tinyTexts = [
    '', 'the hello world', ' the', 'aaaa', 'aaaaa', 'lower newest', 'low lower lowest', '12345 123 1234567',
    'café', '  x   y', '\n\n\nz', "it's hello's", 'hello', ' hello', 'hellohello',
    '<tool_call><tool><sep>x<Ġ>hello', '<sep>xy <tool_callx', '<｜begin▁of▁sentence｜>the<｜end▁of▁sentence｜>',
    'a'.repeat(70), 'ab'.repeat(40), 'hello world\u0085  \u3000x', 'wor world  worlds',
  ];
  const tinyTok = Tokenizer.fromFile(TINY_JSON);
  const tinyDecode = [
    idsOf(tinyTok, ['<Ġ>', 'hello', 'Ġw', '<sep>']),
    idsOf(tinyTok, [[0xc3], 'a', [0xa9]]),
    idsOf(tinyTok, ['<｜begin▁of▁sentence｜>', 'the', '<tool>', '<｜end▁of▁sentence｜>']),
  ];
  write('tiny_expected.json', {
    generator: 'tests/reference/tokenizer/make_expected.js',
    tokenizers_version: HF_VERSION,
    encode: await encodeAll(tinyTok, tinyTexts),
    encode_array_merges: await encodeAll(Tokenizer.fromString(JSON.stringify(arrayMerges)), tinyTexts),
    encode_gpt2: await encodeAll(Tokenizer.fromString(JSON.stringify(gpt2)), tinyTexts),
    decode: [...(await decodeAll(tinyTok, tinyDecode, false)), ...(await decodeAll(tinyTok, tinyDecode, true))],
  });
}

main().catch((e) => {
  console.error(e);
  process.exit(1);
});
