// Writes tests/data/tokenizer/tiny/tokenizer.json: a byte-level BPE tokenizer
// small enough to reason about by hand, for the unit tests of BPE mechanics,
// added tokens and malformed files. Ids 0..255 are the byte-level symbols in
// byte order; merged tokens follow in merge order; added tokens come last.
//
// Regenerate (no packages needed), from the repository root:
//   node tests/reference/tokenizer/make_tiny_tokenizer.js
'use strict';
const fs = require('fs');
const path = require('path');

// GPT-2's bytes_to_unicode.
function byteToChar(b) {
  const printable = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || b >= 174;
  if (printable) return String.fromCodePoint(b);
  let n = 0;
  for (let c = 0; c < b; c++) {
    const p = (c >= 33 && c <= 126) || (c >= 161 && c <= 172) || c >= 174;
    if (!p) n++;
  }
  return String.fromCodePoint(256 + n);
}

const vocab = {};
for (let b = 0; b < 256; b++) vocab[byteToChar(b)] = b;

// [left, right] in rank order. They are written "left right"; the tests
// also load a copy with every merge as a ["left", "right"] array.
const merges = [
  ['h', 'e'], ['l', 'l'], ['Ġ', 't'], ['Ġt', 'he'], ['t', 'he'], ['he', 'll'], ['hell', 'o'],
  ['l', 'o'], ['lo', 'w'], ['e', 'r'], ['low', 'er'],
  // "aaaa": (a,a) outranks (aa,a), so it becomes [aa, aa], not [aaa, a].
  ['a', 'a'], ['aa', 'a'],
  ['e', 's'], ['es', 't'], ['n', 'e'], ['ne', 'w'], ['new', 'est'],
  ['1', '2'], ['12', '3'],
  ['Ã', '©'],  // é = C3 A9
  ['Ġ', 'Ġ'], ['ĠĠ', 'ĠĠ'], ['Ċ', 'Ċ'], ['o', 'r'], ['Ġ', 'w'], ['Ġw', 'or'],
  ["'", 's'], ['Ġ', 'hello'],
];
const mergeList = [];
let next = 256;
for (const [a, b] of merges) {
  for (const t of [a, b]) if (!(t in vocab)) throw new Error(`merge ${a} ${b}: ${t} not yet in vocab`);
  if (!(a + b in vocab)) vocab[a + b] = next++;
  mergeList.push(`${a} ${b}`);
}

const added = [];
function add(content, special, normalized, id) {
  added.push({id: id !== undefined ? id : next++, content, single_word: false, lstrip: false, rstrip: false,
              normalized, special});
}
add('<｜begin▁of▁sentence｜>', true, false);
add('<｜end▁of▁sentence｜>', true, false);
add('<tool>', false, true);
add('<tool_call>', false, true);     // leftmost-longest: "<tool_call>" beats "<tool>"
add('<sep>', true, false);
add('<sep>x', false, true);          // never matches: "<sep>" is found first, in the raw pass
add('<Ġ>', true, false);             // all byte-level characters: decodes to "< >"
add('hello', false, true, vocab['hello']);  // already a model token: keeps the model's id

const tokenizer = {
  version: '1.0',
  truncation: null,
  padding: null,
  added_tokens: added,
  normalizer: null,
  pre_tokenizer: {
    type: 'Sequence',
    pretokenizers: [
      {type: 'Split', pattern: {Regex: '\\p{N}{1,3}'}, behavior: 'Isolated', invert: false},
      {
        type: 'Split',
        pattern: {Regex: "'s|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\s+(?!\\S)|\\s+|[^\\s\\p{L}\\p{N}]+"},
        behavior: 'Isolated',
        invert: false,
      },
      {type: 'ByteLevel', add_prefix_space: false, trim_offsets: true, use_regex: false},
    ],
  },
  post_processor: {type: 'ByteLevel', add_prefix_space: true, trim_offsets: false, use_regex: true},
  decoder: {type: 'ByteLevel', add_prefix_space: true, trim_offsets: true, use_regex: true},
  model: {
    type: 'BPE', dropout: null, unk_token: null, continuing_subword_prefix: null, end_of_word_suffix: null,
    fuse_unk: false, byte_fallback: false, vocab, merges: mergeList,
  },
};
const out = path.join(__dirname, '..', '..', 'data', 'tokenizer', 'tiny', 'tokenizer.json');
fs.mkdirSync(path.dirname(out), {recursive: true});
fs.writeFileSync(out, JSON.stringify(tokenizer, null, 1) + '\n');
console.log(`wrote ${out}: ${Object.keys(vocab).length} vocab entries, ${mergeList.length} merges, ` +
            `${added.length} added tokens`);
