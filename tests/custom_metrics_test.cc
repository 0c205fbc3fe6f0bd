#include "metrics/custom_metrics.h"

#include <gtest/gtest.h>

#include <string>

namespace quern {
namespace {

// A model's values that arrive between its batches: its refresher runs at each Render, before the
// families are written, and not once removed.
TEST(CustomMetricsTest, RefreshersRunAtEachRenderUntilRemoved) {
  CustomMetrics store;
  ASSERT_TRUE(store.Declare("gathered", "what a refresher applied", CustomMetrics::Kind::kCounter).ok());
  int runs = 0;
  int key = 0;
  store.AddRefresher(&key, [&] {
    ++runs;
    ASSERT_TRUE(store.Add("gathered", {{"model", "m"}}, 2).ok());
  });
  std::string first;
  store.Render(first);
  EXPECT_EQ(runs, 1);
  EXPECT_NE(first.find("gathered{model=\"m\"} 2\n"), std::string::npos) << first;
  std::string second;
  store.Render(second);
  EXPECT_NE(second.find("gathered{model=\"m\"} 4\n"), std::string::npos) << second;
  // Added again under its key: replaced, not run twice.
  store.AddRefresher(&key, [&] { runs += 10; });
  std::string third;
  store.Render(third);
  EXPECT_EQ(runs, 12);
  store.RemoveRefresher(&key);
  std::string fourth;
  store.Render(fourth);
  EXPECT_EQ(runs, 12);
  EXPECT_NE(fourth.find("gathered{model=\"m\"} 4\n"), std::string::npos) << fourth;
}

}  // namespace
}  // namespace quern
