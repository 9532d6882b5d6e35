// Engram's token classes (the "compressed tokenizer" of DeepSeek's Engram
// demo, which MaxText and DeepSeek-V4.1 use) from Hugging Face's own
// tokenizer library, for the C++ tests:
//   tests/data/tokenizer/engram_classes.json
// For every id: decode it alone (special tokens kept); a text holding U+FFFD
// is keyed by the raw token string, any other by the text after NFKC, NFD,
// strip accents, lowercase (Hugging Face's normalizers), each run of
// [ \t\r\n] to one space, a lone " " protected through U+E000, strip
// (Hugging Face's), U+E000 back to " "; an empty result by the decoded text.
// Classes are numbered in first-seen order. Written: the tiny tokenizer's
// whole table, DeepSeek-V3's class count, its table's SHA-256 (little-endian
// int32) and every id whose class is shared with a lower id.
//
// Regenerate, from the repository root:
//   bash scripts/fetch_tokenizer_assets.sh
//   node tests/reference/tokenizer/make_engram_classes.js
'use strict';
const fs = require('fs');
const path = require('path');
const crypto = require('crypto');

const ROOT = path.join(__dirname, '..', '..', '..');
const NPM = path.join(ROOT, '.cache', 'npm', 'node_modules');
const hf = require(path.join(NPM, 'tokenizers'));
const DS_JSON = path.join(NPM, '@lenml', 'tokenizer-deepseek_v3', 'models', 'tokenizer.json');
const TINY_JSON = path.join(ROOT, 'tests', 'data', 'tokenizer', 'tiny', 'tokenizer.json');

const norm = hf.sequenceNormalizer([hf.nfkcNormalizer(), hf.nfdNormalizer(), hf.stripAccentsNormalizer(),
                                    hf.lowercase()]);
const strip = hf.stripNormalizer(true, true);
const SENTINEL = '\uE000';

function key(text, raw) {
  if (text.includes('\uFFFD')) return raw;
  let s = norm.normalizeString(text).replace(/[ \t\r\n]+/g, ' ');
  if (s === ' ') s = SENTINEL;
  s = strip.normalizeString(s).split(SENTINEL).join(' ');
  return s === '' ? text : s;
}

async function classes(file) {
  const tok = hf.Tokenizer.fromFile(file);
  const V = tok.getVocabSize(true);
  const seen = new Map();
  const lut = new Int32Array(V);
  for (let id = 0; id < V; ++id) {
    const text = await tok.decode([id], false);
    const raw = tok.idToToken(id);
    const k = key(text, raw === null ? text : raw);
    if (!seen.has(k)) seen.set(k, seen.size);
    lut[id] = seen.get(k);
  }
  return {lut, count: seen.size};
}

// Texts whose keys pin the normal form: compatibility forms, accents and
// other marks, dotted capitals, final sigma, whitespace runs and kinds,
// lone spaces, the sentinel itself, empty results.
const KEY_TEXTS = ['Hello', 'Héllo', 'HÉLLO', '\uFB01', '\u2460', 'Ａｂｃ', 'İstanbul', 'ΣΑΣ', 'ὈΔΥΣΣΕΎΣ', 'ß', 'ﬀ',
  ' ', '  ', '\t', '\n', ' \t\r\n ', '  a  b\t\tc\n', '\u00A0x\u00A0', '\u2003y\u3000', '\u0085z\u0085',
  '\uFEFFw', 'a\uE000b', '\uE000', '\u0301', 'e\u0301', '\u20DD', 'क्षि', '가나', 'Ǆ', 'ǅ', '\u1E9E', 'Ⅻ', '㎏',
  '½', 'ﷺ', '\u0130', 'ﬃx', 'A\u030A', '\u212B', 'x\u200By', '\u00AD', '😀', 'Ⓐ'];

(async () => {
  const keys = KEY_TEXTS.map((t) => [t, key(t, t)]);
  const tiny = await classes(TINY_JSON);
  const ds = await classes(DS_JSON);
  const shared = [];
  const first = new Map();
  for (let id = 0; id < ds.lut.length; ++id) {
    if (first.has(ds.lut[id])) shared.push([id, ds.lut[id]]);
    else first.set(ds.lut[id], id);
  }
  const sha = crypto.createHash('sha256').update(Buffer.from(ds.lut.buffer)).digest('hex');
  const out = {
    generator: 'tests/reference/tokenizer/make_engram_classes.js',
    tokenizers: require(path.join(NPM, 'tokenizers', 'package.json')).version,
    keys,
    tiny: {classes: tiny.count, table: Array.from(tiny.lut)},
    deepseek_v3: {vocab: ds.lut.length, classes: ds.count, sha256: sha, shared},
  };
  fs.writeFileSync(path.join(ROOT, 'tests', 'data', 'tokenizer', 'engram_classes.json'), JSON.stringify(out) + '\n');
  console.log(`tiny: ${tiny.count} classes of ${tiny.lut.length}; deepseek_v3: ${ds.count} of ${ds.lut.length}, ` +
              `${shared.length} ids share a class, sha256 ${sha}`);
})();
