// Tests for llm.c token shards (write_token_shard / TokenShard) and expand_glob.
#include <gtest/gtest.h>

#include "support.h"

#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "data/token_shard.h"

namespace fs = std::filesystem;
using tally::data::expand_glob;
using tally::data::TokenShard;
using tally::data::TokenWidth;
using tally::data::write_token_shard;

namespace {

std::string scratch_dir() {
  const auto* info = testing::UnitTest::GetInstance()->current_test_info();
  const fs::path dir = fs::path(testing::TempDir()) / (std::string("tally_shard_") + info->name());
  fs::remove_all(dir);
  fs::create_directories(dir);
  return dir.string();
}

using tally::test::read_all;
using tally::test::write_all;

std::string header(int32_t magic, int32_t version, int32_t ntok) {
  int32_t h[256] = {};
  h[0] = magic;
  h[1] = version;
  h[2] = ntok;
  return std::string(reinterpret_cast<const char*>(h), sizeof h);
}

using tally::test::message_of;

// ---------------------------------------------------------------------------------------------

TEST(TokenShard, RoundTripsU16) {
  const std::string path = scratch_dir() + "/gpt2.bin";
  const std::vector<int32_t> tokens = {0, 1, 50256, 65535, 15496, 995, 7};
  write_token_shard(path, tokens, TokenWidth::U16);
  EXPECT_FALSE(tally::test::has_temporaries(path));
  EXPECT_EQ(fs::file_size(path), 1024 + 2 * tokens.size());

  // The exact llm.c layout: header {20240520, 1, n, 0...}, then little-endian uint16.
  const std::string raw = read_all(path);
  EXPECT_EQ(raw.substr(0, 1024), header(20240520, 1, static_cast<int32_t>(tokens.size())));
  uint16_t third;
  std::memcpy(&third, raw.data() + 1024 + 2 * 2, 2);
  EXPECT_EQ(third, 50256);

  const TokenShard s = TokenShard::open(path);
  EXPECT_EQ(s.size(), static_cast<int64_t>(tokens.size()));
  EXPECT_EQ(s.width(), TokenWidth::U16);
  EXPECT_EQ(s.path(), path);
  for (std::size_t i = 0; i < tokens.size(); ++i) EXPECT_EQ(s.at(static_cast<int64_t>(i)), tokens[i]);
  std::vector<int32_t> got(3, -1);
  s.read(2, 3, got.data());
  EXPECT_EQ(got, (std::vector<int32_t>{50256, 65535, 15496}));
}

TEST(TokenShard, RoundTripsU32) {
  const std::string path = scratch_dir() + "/llama3.bin";
  const std::vector<int32_t> tokens = {128000, 0, 65536, 128255, 2147483647};
  write_token_shard(path, tokens, TokenWidth::U32);
  EXPECT_EQ(fs::file_size(path), 1024 + 4 * tokens.size());
  EXPECT_EQ(read_all(path).substr(0, 1024), header(20240801, 7, static_cast<int32_t>(tokens.size())));
  const TokenShard s = TokenShard::open(path);
  EXPECT_EQ(s.width(), TokenWidth::U32);
  std::vector<int32_t> got(tokens.size());
  s.read(0, s.size(), got.data());
  EXPECT_EQ(got, tokens);
}

TEST(TokenShard, EmptyShardAndMoves) {
  const std::string dir = scratch_dir();
  write_token_shard(dir + "/empty.bin", {}, TokenWidth::U16);
  TokenShard a = TokenShard::open(dir + "/empty.bin");
  EXPECT_EQ(a.size(), 0);
  a.read(0, 0, nullptr);  // an empty read at the end is fine

  write_token_shard(dir + "/one.bin", {42}, TokenWidth::U16);
  TokenShard b = TokenShard::open(dir + "/one.bin");
  a = std::move(b);  // unmaps the empty shard, takes over the other mapping
  EXPECT_EQ(a.size(), 1);
  EXPECT_EQ(a.at(0), 42);
  TokenShard c(std::move(a));
  EXPECT_EQ(c.at(0), 42);
  EXPECT_EQ(c.path(), dir + "/one.bin");
}

TEST(TokenShard, OverwritesAtomically) {
  const std::string path = scratch_dir() + "/shard.bin";
  write_token_shard(path, {1, 2, 3}, TokenWidth::U16);
  const TokenShard old = TokenShard::open(path);  // a reader holding the old file
  write_token_shard(path, {4, 5}, TokenWidth::U16);
  EXPECT_EQ(old.size(), 3);  // rename replaced the name; the old mapping is intact
  EXPECT_EQ(old.at(2), 3);
  const TokenShard now = TokenShard::open(path);
  EXPECT_EQ(now.size(), 2);
  EXPECT_EQ(now.at(0), 4);
}

TEST(TokenShard, RejectsTokensThatDoNotFit) {
  const std::string path = scratch_dir() + "/bad.bin";
  std::string msg = message_of<std::runtime_error>([&] { write_token_shard(path, {1, 2, 65536}, TokenWidth::U16); });
  EXPECT_NE(msg.find(path), std::string::npos) << msg;
  EXPECT_NE(msg.find("token 2 is 65536"), std::string::npos) << msg;
  EXPECT_NE(msg.find("uint16"), std::string::npos) << msg;
  msg = message_of<std::runtime_error>([&] { write_token_shard(path, {-5}, TokenWidth::U32); });
  EXPECT_NE(msg.find("token 0 is -5"), std::string::npos) << msg;
  EXPECT_FALSE(fs::exists(path));
  EXPECT_FALSE(tally::test::has_temporaries(path));

  msg = message_of<std::runtime_error>(
      [&] { write_token_shard(scratch_dir() + "/no/such/dir/x.bin", {1}, TokenWidth::U16); });
  EXPECT_NE(msg.find("no/such/dir/x.bin"), std::string::npos) << msg;
}

TEST(TokenShard, ValidatesTheFile) {
  const std::string dir = scratch_dir();
  const std::string path = dir + "/x.bin";

  write_all(path, header(12345, 1, 0));
  std::string msg = message_of<std::runtime_error>([&] { TokenShard::open(path); });
  EXPECT_NE(msg.find("'" + path + "'"), std::string::npos) << msg;
  EXPECT_NE(msg.find("bad magic 12345"), std::string::npos) << msg;
  EXPECT_NE(msg.find("20240520"), std::string::npos) << msg;

  write_all(path, header(20240520, 7, 0));  // LLaMA-3's version with GPT-2's magic
  msg = message_of<std::runtime_error>([&] { TokenShard::open(path); });
  EXPECT_NE(msg.find(path), std::string::npos) << msg;
  EXPECT_NE(msg.find("version 7, expected 1"), std::string::npos) << msg;

  // Truncated: the header promises more tokens than the file holds.
  write_all(path, header(20240520, 1, 5000) + std::string(3000 - 1024, '\0'));
  msg = message_of<std::runtime_error>([&] { TokenShard::open(path); });
  EXPECT_EQ(msg, "tally: token shard '" + path +
                     "': file is 3000 bytes but header says 5000 tokens (expected 11024 bytes)");

  // Trailing garbage is rejected too.
  write_all(path, header(20240801, 7, 2) + std::string(9, '\0'));
  msg = message_of<std::runtime_error>([&] { TokenShard::open(path); });
  EXPECT_NE(msg.find("file is 1033 bytes but header says 2 tokens (expected 1032 bytes)"), std::string::npos) << msg;

  write_all(path, header(20240520, 1, -1));
  msg = message_of<std::runtime_error>([&] { TokenShard::open(path); });
  EXPECT_NE(msg.find("-1 tokens"), std::string::npos) << msg;

  write_all(path, "short");
  msg = message_of<std::runtime_error>([&] { TokenShard::open(path); });
  EXPECT_NE(msg.find(path), std::string::npos) << msg;
  EXPECT_NE(msg.find("file is 5 bytes"), std::string::npos) << msg;

  msg = message_of<std::runtime_error>([&] { TokenShard::open(dir + "/missing.bin"); });
  EXPECT_NE(msg.find(dir + "/missing.bin"), std::string::npos) << msg;

  msg = message_of<std::runtime_error>([&] { TokenShard::open(dir); });
  EXPECT_NE(msg.find("directory"), std::string::npos) << msg;
}

TEST(TokenShard, RangeChecks) {
  const std::string path = scratch_dir() + "/r.bin";
  write_token_shard(path, {1, 2, 3}, TokenWidth::U16);
  const TokenShard s = TokenShard::open(path);
  int32_t buf[4];
  EXPECT_THROW(s.at(3), std::out_of_range);
  EXPECT_THROW(s.at(-1), std::out_of_range);
  EXPECT_THROW(s.read(2, 2, buf), std::out_of_range);
  EXPECT_THROW(s.read(0, -1, buf), std::out_of_range);
  const std::string msg = message_of<std::out_of_range>([&] { s.read(1, 3, buf); });
  EXPECT_NE(msg.find(path), std::string::npos) << msg;
  s.read(1, 2, buf);
  EXPECT_EQ(buf[0], 2);
  EXPECT_EQ(buf[1], 3);
}

TEST(ExpandGlob, SortedMatchesAndClearError) {
  const std::string dir = scratch_dir();
  for (const char* name : {"train_010.bin", "train_002.bin", "train_001.bin", "val_000.bin", "notes.txt"})
    write_all(dir + "/" + name, "x");
  EXPECT_EQ(expand_glob(dir + "/train_*.bin"),
            (std::vector<std::string>{dir + "/train_001.bin", dir + "/train_002.bin", dir + "/train_010.bin"}));
  EXPECT_EQ(expand_glob(dir + "/val_000.bin"), (std::vector<std::string>{dir + "/val_000.bin"}));
  const std::string msg = message_of<std::runtime_error>([&] { expand_glob(dir + "/test_*.bin"); });
  EXPECT_NE(msg.find(dir + "/test_*.bin"), std::string::npos) << msg;
}

}  // namespace
