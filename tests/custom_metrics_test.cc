#include "metrics/custom_metrics.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <limits>
#include <string>
#include <vector>

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

// A histogram's observations gathered by the model's process (counts per bucket, +Inf last, and
// their sum) count as the same observations one by one.
TEST(CustomMetricsTest, GatheredObservationsCountAsObservedOneByOne) {
  CustomMetrics gathered, one_by_one;
  const std::vector<double> values = {0.5, 1, 2, 7, 10, 11, 250};
  ASSERT_TRUE(gathered
                  .Apply("m", R"([{"op":"declare","name":"h","help":"","kind":"histogram"},
                                  {"op":"observe","name":"h","labels":{"a":"b"},"buckets":[1,10],
                                   "counts":[2,3,2],"value":281.5}])")
                  .ok());
  ASSERT_TRUE(one_by_one.Declare("h", "", CustomMetrics::Kind::kHistogram).ok());
  for (double v : values) ASSERT_TRUE(one_by_one.Observe("h", {{"a", "b"}}, {1, 10}, v).ok());
  std::string a, b;
  gathered.Render(a);
  one_by_one.Render(b);
  EXPECT_EQ(a, b);
  EXPECT_NE(a.find("h_bucket{a=\"b\",le=\"10\"} 5\n"), std::string::npos) << a;
  EXPECT_NE(a.find("h_count{a=\"b\"} 7\n"), std::string::npos) << a;
  // Counts that do not fit the buckets, or are not whole numbers: refused, saying why; nothing counted.
  for (const char* bad : {R"([{"op":"observe","name":"h","labels":{"a":"b"},"buckets":[1,10],"counts":[1,1]}])",
                          R"([{"op":"observe","name":"h","labels":{"a":"b"},"buckets":[1,10],"counts":[1,-1,0]}])",
                          R"([{"op":"observe","name":"h","labels":{"a":"b"},"buckets":[1,10],"counts":[1,0.5,0]}])",
                          R"([{"op":"observe","name":"h","labels":{"a":"b"},"buckets":[1,10],"counts":3}])"}) {
    const Status st = gathered.Apply("m", bad);
    EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << bad;
    EXPECT_NE(st.message().find("histogram 'h'"), std::string::npos) << st.ToString();
  }
  std::string after;
  gathered.Render(after);
  EXPECT_EQ(after, a);
}

// What Prometheus could not read, refused with the reason: a histogram labelled 'le' (its buckets'
// own label), a label name twice, a bucket at infinity (+Inf is every histogram's last), counts past
// 2^64; nothing of a refused operation is counted.
TEST(CustomMetricsTest, LabelsAndBucketsPrometheusCannotReadAreRefused) {
  CustomMetrics store;
  ASSERT_TRUE(store.Declare("h", "", CustomMetrics::Kind::kHistogram).ok());
  ASSERT_TRUE(store.Declare("c", "", CustomMetrics::Kind::kCounter).ok());
  const Status le = store.Observe("h", {{"le", "x"}}, {1}, 0.5);
  EXPECT_EQ(le.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(le.message().find("'le'"), std::string::npos) << le.ToString();
  const Status twice = store.Apply("m", R"([{"op":"add","name":"c","labels":{"a":"1","a":"2"},"value":1}])");
  EXPECT_NE(twice.message().find("label 'a' given twice"), std::string::npos) << twice.ToString();
  const Status inf = store.Observe("h", {}, {1, std::numeric_limits<double>::infinity()}, 1);
  EXPECT_NE(inf.message().find("finite"), std::string::npos) << inf.ToString();
  ASSERT_TRUE(store.ObserveCounts("h", {}, {1}, {1, 0}, 0.5).ok());
  const Status past = store.ObserveCounts("h", {}, {1}, {0, UINT64_MAX}, 1);
  EXPECT_NE(past.message().find("2^64"), std::string::npos) << past.ToString();
  std::string text;
  store.Render(text);
  EXPECT_NE(text.find("h_count 1\n"), std::string::npos) << text;
  EXPECT_NE(text.find("h_bucket{le=\"+Inf\"} 1\n"), std::string::npos) << text;
  EXPECT_EQ(text.find("c{"), std::string::npos) << text;
}

}  // namespace
}  // namespace quern
