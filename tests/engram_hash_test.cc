// model/engram_hash.h against the published test vectors: MaxText's int32
// scheme (its toy layout) and DeepSeek-V4.1-Flash's int64 scheme (its real
// primes, multipliers and ids), plus the invariants: a history continues a
// sequence exactly, and changing a token moves only the next N ids.
#include "model/engram_hash.h"

#include <gtest/gtest.h>

#include <numeric>

#include "core/error.h"

using ds::model::EngramHashScheme;
using ds::model::EngramHashSpec;

namespace {
namespace engram_hash_test {

std::vector<int32_t> ids_of(const std::vector<int32_t>& c, const ds::model::EngramLayerHash& t, const EngramHashSpec& s,
                            int32_t pad) {
  std::vector<int32_t> ids(c.size() * (s.max_ngram - 1) * s.heads);
  ds::model::engram_hash_ids(ids.data(), c.data(), 1, static_cast<int64_t>(c.size()), nullptr, pad, t, s.max_ngram,
                             s.heads);
  return ids;
}

TEST(EngramHash, MaxTextInt32ToyVectors) {
  EngramHashSpec s{{1, 4}, 3, 2, {128, 128}, 0, 128, EngramHashScheme::Int32};
  const auto t = ds::model::engram_hash_tables(s);
  ASSERT_EQ(t.size(), 2u);
  EXPECT_EQ(t[0].multipliers, (std::vector<int64_t>{2516509, 13812727, 10401139}));
  EXPECT_EQ(t[1].multipliers, (std::vector<int64_t>{16580071, 14827181, 6383963}));
  EXPECT_EQ(t[0].primes, (std::vector<int64_t>{131, 137, 139, 149}));
  EXPECT_EQ(t[1].primes, (std::vector<int64_t>{151, 157, 163, 167}));
  EXPECT_EQ(t[0].offsets, (std::vector<int64_t>{0, 131, 268, 407}));
  EXPECT_EQ(t[0].rows, 556);
  // Published ids are per column, without the column's offset.
  const std::vector<std::vector<int32_t>> want = {{126, 54, 126, 91}, {67, 45, 76, 2},   {50, 89, 114, 71},
                                                  {110, 14, 22, 138}, {85, 106, 96, 85}, {32, 28, 2, 83}};
  const auto ids = ids_of({5, 17, 42, 7, 0, 99}, t[0], s, 0);
  for (size_t i = 0; i < want.size(); ++i)
    for (size_t c = 0; c < 4; ++c) EXPECT_EQ(ids[i * 4 + c] - t[0].offsets[c], want[i][c]) << i << "," << c;
}

TEST(EngramHash, MaxTextCustomPrimes) {
  // deepseek-custom: bases 226240 for both orders, H = 8, layers [1, 4].
  EngramHashSpec s{{1, 4}, 3, 8, {226240, 226240}, 0, 1000, EngramHashScheme::Int32};
  const auto t = ds::model::engram_hash_tables(s);
  EXPECT_EQ(t[0].primes[0], 226241);
  EXPECT_EQ(t[0].primes[1], 226267);
  EXPECT_EQ(t[1].primes[0], 226463);
}

EngramHashSpec flash_spec() {
  return EngramHashSpec{{1, 14}, 4, 8, {16000000, 16000000, 16000000}, 0, 99092, EngramHashScheme::Int64};
}

TEST(EngramHash, V41FlashConstants) {
  const auto s = flash_spec();
  const auto t = ds::model::engram_hash_tables(s);
  EXPECT_EQ(t[0].multipliers, (std::vector<int64_t>{76632096046245, 4839876093313, 35959672319349, 73987337458391}));
  EXPECT_EQ(t[1].multipliers, (std::vector<int64_t>{67716810739261, 51510806800915, 30921347202721, 82619226485591}));
  EXPECT_EQ(t[0].primes,
            (std::vector<int64_t>{16000057, 16000079, 16000081, 16000097, 16000121, 16000129, 16000133, 16000183,
                                  16000189, 16000207, 16000211, 16000253, 16000277, 16000289, 16000307, 16000321,
                                  16000339, 16000381, 16000393, 16000399, 16000403, 16000409, 16000447, 16000463}));
  EXPECT_EQ(t[0].rows, 384006168);
  EXPECT_EQ(t[1].rows, 384016682);
  EXPECT_EQ(t[1].primes[0], 16000477);
  EXPECT_EQ(t[1].primes[8], 16000667);
  EXPECT_EQ(t[1].primes[16], 16000781);
  EXPECT_EQ(t[0].offsets[1], 16000057);
  EXPECT_EQ(t[0].offsets[2], 32000136);
  EXPECT_EQ(t[0].offsets[23], 368005705);
}

TEST(EngramHash, V41FlashIds) {
  const auto s = flash_spec();
  const auto t = ds::model::engram_hash_tables(s);
  const std::vector<int32_t> c = {5, 17, 42, 7, 0, 99, 12, 3};
  const auto a = ids_of(c, t[0], s, 2), b = ids_of(c, t[1], s, 2);
  auto at = [](const std::vector<int32_t>& v, int t) {
    return std::vector<int32_t>(v.begin() + t * 24, v.begin() + t * 24 + 24);
  };
  EXPECT_EQ(at(a, 0), (std::vector<int32_t>{5412672,   18319159,  35492627,  60880252,  74962984,  95657733,
                                            98005115,  127351390, 143494632, 151789366, 171410756, 185435171,
                                            207165545, 218031260, 226330336, 247008214, 256353435, 276423911,
                                            295874085, 305599364, 322749888, 348475788, 367405771, 372009279}));
  EXPECT_EQ(at(a, 3), (std::vector<int32_t>{10635489,  23985305,  39744525,  53818166,  66930043,  81967808,
                                            97486831,  123477372, 129073017, 154417363, 167160983, 188974908,
                                            201446056, 223683563, 233041460, 245654968, 263877802, 280761434,
                                            292444171, 306285994, 331514375, 345356492, 353025140, 373940797}));
  EXPECT_EQ(at(a, 7), (std::vector<int32_t>{2281283,   22914694,  39336035,  58706500,  79763133,  81448893,
                                            98291950,  124831383, 138730329, 147699702, 165694291, 186661342,
                                            198663874, 220671249, 229689168, 252709460, 261742913, 282854948,
                                            288895694, 307917918, 325933411, 344957265, 364128322, 372211994}));
  EXPECT_EQ(at(b, 7), (std::vector<int32_t>{9546311,   26263184,  33523786,  59698642,  72786210,  83648852,
                                            105450518, 116354087, 140323143, 148199242, 162714869, 178469091,
                                            201609826, 208509387, 230689158, 254086894, 269366022, 276288937,
                                            299456250, 307100384, 329800989, 343692851, 367577705, 374996942}));
  const int64_t sa = std::accumulate(a.begin(), a.end(), int64_t{0}),
                sb = std::accumulate(b.begin(), b.end(), int64_t{0});
  EXPECT_EQ(sa, 36815482802);
  EXPECT_EQ(sb, 36880946150);
}

TEST(EngramHash, V41DeadPositionsBlockTheLookBack) {
  // Position 3 an image token: its n-grams and those that reach back over it
  // read pad from there on (positions 3..6 change, nothing else).
  const auto s = flash_spec();
  const auto t = ds::model::engram_hash_tables(s);
  std::vector<int32_t> c = {5, 17, 42, 7, 0, 99, 12, 3};
  const auto before = ids_of(c, t[0], s, 2);
  c[3] = ds::model::kEngramDead;
  const auto a = ids_of(c, t[0], s, 2), b = ids_of(c, t[1], s, 2);
  for (int i = 0; i < 8; ++i) {
    const bool same = std::equal(before.begin() + i * 24, before.begin() + i * 24 + 24, a.begin() + i * 24);
    EXPECT_EQ(same, i < 3 || i > 6) << i;
  }
  EXPECT_EQ(
      std::vector<int32_t>(a.begin() + 4 * 24, a.begin() + 5 * 24),
      (std::vector<int32_t>{5702652,   24393184,  39183301,  61503783,  78984481,  90144770,  103724983, 121476532,
                            131476717, 152385926, 164143652, 191599181, 198145581, 217419202, 238329687, 247482304,
                            257520185, 283540304, 288689443, 315264704, 322314652, 348890037, 367865216, 380066193}));
  EXPECT_EQ(std::accumulate(a.begin(), a.end(), int64_t{0}) + std::accumulate(b.begin(), b.end(), int64_t{0}),
            73728092226);
}

TEST(EngramHash, V41ToyLayout) {
  EngramHashSpec s{{0, 1}, 3, 2, {100, 100}, 0, 256, EngramHashScheme::Int64};
  const auto t = ds::model::engram_hash_tables(s);
  EXPECT_EQ(t[0].primes, (std::vector<int64_t>{101, 103, 107, 109}));
  EXPECT_EQ(t[1].primes, (std::vector<int64_t>{113, 127, 131, 137}));
  EXPECT_EQ(t[0].multipliers, (std::vector<int64_t>{22948963341361471, 9720090748611819, 1476226777048821}));
  EXPECT_EQ(t[1].multipliers, (std::vector<int64_t>{29662608052400909, 1873410163432121, 13919202536988139}));
  const std::vector<int32_t> c = {5, 17, 42, 7, 0, 99};
  EXPECT_EQ(ids_of(c, t[0], s, 1), (std::vector<int32_t>{43, 135, 218, 388, 49, 105, 220, 343, 58, 101, 205, 324,
                                                         38, 123, 205, 336, 50, 144, 244, 347, 81, 198, 271, 419}));
  EXPECT_EQ(ids_of(c, t[1], s, 1), (std::vector<int32_t>{54, 175, 251, 460, 21, 226, 297, 486, 58, 124, 260, 400,
                                                         60, 221, 343, 385, 63, 171, 323, 460, 60, 187, 319, 476}));
}

TEST(EngramHash, HistoryContinuesTheSequenceAndChangesStayLocal) {
  EngramHashSpec s{{2}, 4, 3, {50, 70, 90}, 7, 300, EngramHashScheme::Int32};
  const auto t = ds::model::engram_hash_tables(s)[0];
  std::vector<int32_t> c = {3, 250, 17, 0, 99, 12, 7, 7, 141, 5};
  const auto full = ids_of(c, t, s, 4);
  const int64_t C = 9;
  for (int64_t split = 1; split < 10; ++split) {  // the tail alone, with the 3 tokens before it as history
    std::vector<int32_t> hist(3);
    for (int64_t j = 0; j < 3; ++j) hist[j] = split - 3 + j >= 0 ? c[split - 3 + j] : 4;
    std::vector<int32_t> tail(c.begin() + split, c.end()), ids(tail.size() * C);
    ds::model::engram_hash_ids(ids.data(), tail.data(), 1, static_cast<int64_t>(tail.size()), hist.data(), 4, t, 4, 3);
    EXPECT_EQ(ids, std::vector<int32_t>(full.begin() + split * C, full.end())) << split;
  }
  for (int32_t id : full) EXPECT_TRUE(id >= 0 && id < t.rows);
  auto c2 = c;
  c2[4] = 100;
  const auto moved = ids_of(c2, t, s, 4);
  for (int64_t i = 0; i < 10; ++i) {
    const bool same = std::equal(full.begin() + i * C, full.begin() + (i + 1) * C, moved.begin() + i * C);
    EXPECT_EQ(same, i < 4 || i > 7) << i;
  }
}

TEST(EngramHash, ImpossibleSpecsAreErrors) {
  EngramHashSpec s{{1}, 3, 2, {128}, 0, 128, EngramHashScheme::Int32};
  EXPECT_THROW(ds::model::engram_hash_tables(s), ds::Error);  // one base for two orders
  s.vocab_bases = {128, 0};
  EXPECT_THROW(ds::model::engram_hash_tables(s), ds::Error);
  s.vocab_bases = {128, 128};
  s.compressed_vocab = 0;
  EXPECT_THROW(ds::model::engram_hash_tables(s), ds::Error);
}

}  // namespace engram_hash_test
}  // namespace
