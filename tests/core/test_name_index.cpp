#include <gtest/gtest.h>

#include <string>

#include "core/name_index.h"

namespace refit {
namespace {

TEST(NameIndex, NumbersNamesInOrderAndFindsThemAgain) {
  NameIndex names;
  EXPECT_FALSE(names.find("a").has_value());
  constexpr uint32_t kCount = 50000;  // several times the table's first size: it grows
  for (uint32_t i = 0; i < kCount; ++i) {
    const std::string name = "model.layers." + std::to_string(i / 100) + ".t" + std::to_string(i % 100) + ".weight";
    names.prefetch(name);
    const auto added = names.add(name);
    EXPECT_TRUE(added.added) << name;
    EXPECT_EQ(added.index, i) << name;
  }
  EXPECT_EQ(names.size(), kCount);
  for (uint32_t i = 0; i < kCount; i += 997) {
    const std::string name = "model.layers." + std::to_string(i / 100) + ".t" + std::to_string(i % 100) + ".weight";
    EXPECT_EQ(names.find(name), std::optional<uint32_t>(i)) << name;
    EXPECT_EQ(names.name(i), name);
    const auto again = names.add(name);
    EXPECT_FALSE(again.added) << name;
    EXPECT_EQ(again.index, i) << name;
  }
  EXPECT_EQ(names.size(), kCount);
  EXPECT_FALSE(names.contains("model.layers.0.t0.bias"));
  EXPECT_FALSE(names.contains(""));
}

TEST(NameIndex, ClearForgetsEveryNameAndStartsNumberingAgain) {
  NameIndex names;
  names.add("x");
  names.add("y");
  names.clear();
  EXPECT_TRUE(names.empty());
  EXPECT_FALSE(names.contains("x"));
  EXPECT_EQ(names.add("y").index, 0u);
  EXPECT_TRUE(names.add("").added);  // the empty name is a name
  EXPECT_TRUE(names.contains(""));
  EXPECT_THROW(names.name(5), std::out_of_range);
}

}  // namespace
}  // namespace refit
