// The vision service without a transport: admission by count and by memory,
// timeouts on a fake clock, images whose caller left, and a result computed
// by hand. Stage tasks run when the test says (an executor it holds), so
// every step is deterministic. Also the vision routes' reading of
// min_confidence.
#include "pipeline/vision_service.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <deque>
#include <future>
#include <mutex>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "frontends/vision/vision_handler.h"
#include "test_util.h"

namespace quern {
namespace {

// A 24-bit BMP of `w` x `h` pixels, all (r, g, b).
std::string SolidBmp(int w, int h, uint8_t r, uint8_t g, uint8_t b) {
  const int row = (w * 3 + 3) / 4 * 4;
  const uint32_t pixels = static_cast<uint32_t>(row * h);
  std::string out(54 + pixels, '\0');
  auto put32 = [&](size_t at, uint32_t v) {
    for (int i = 0; i < 4; ++i) out[at + i] = static_cast<char>((v >> (8 * i)) & 0xFF);
  };
  out[0] = 'B';
  out[1] = 'M';
  put32(2, 54 + pixels);
  put32(10, 54);
  put32(14, 40);
  put32(18, static_cast<uint32_t>(w));
  put32(22, static_cast<uint32_t>(h));
  out[26] = 1;   // planes
  out[28] = 24;  // bits per pixel
  put32(34, pixels);
  for (int y = 0; y < h; ++y) {
    for (int x = 0; x < w; ++x) {
      const size_t at = 54 + static_cast<size_t>(y * row + x * 3);
      out[at] = static_cast<char>(b);
      out[at + 1] = static_cast<char>(g);
      out[at + 2] = static_cast<char>(r);
    }
  }
  return out;
}

// Scores are the mean of each colour channel: a pure colour scores 1 for
// its own channel and 0 for the others.
class ChannelMeans : public Model {
 public:
  Status Execute(const std::vector<NamedTensor>& inputs, int64_t batch_size,
                 std::vector<NamedTensor>& outputs) override {
    const auto in = inputs.at(0).tensor.values<float>();
    const size_t plane = in.size() / static_cast<size_t>(batch_size) / 3;
    std::vector<float> scores;
    for (int64_t n = 0; n < batch_size; ++n) {
      for (int c = 0; c < 3; ++c) {
        float sum = 0;
        for (size_t i = 0; i < plane; ++i) sum += in[(static_cast<size_t>(n) * 3 + c) * plane + i];
        scores.push_back(sum / static_cast<float>(plane));
      }
    }
    outputs = {{"scores", testing::Floats({batch_size, 3}, scores)}};
    return Status::Ok();
  }
};

class VisionServiceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto e = Engine::Create({});
    ASSERT_TRUE(e.has_value());
    engine_ = std::move(*e);
    ASSERT_TRUE(RegisterChannelMeans("colour").ok());
  }

  // A classification model `name` on 4x4 images: ChannelMeans.
  Status RegisterChannelMeans(const std::string& name) {
    ModelConfig c;
    c.name = name;
    c.max_batch_size = 1;
    c.instance_count = 1;
    c.inputs = {{.name = "image", .dtype = DataType::kFp32, .dims = {3, 4, 4}}};
    c.outputs = {{.name = "scores", .dtype = DataType::kFp32, .dims = {3}}};
    c.parameters = {{"quern.task", "classification"}};
    return engine_->RegisterModel(c, [] { return std::make_unique<ChannelMeans>(); });
  }

  VisionServiceOptions Options() {
    VisionServiceOptions o;
    o.clock = &clock_;
    o.executor = [this](std::function<void()> task, bool urgent) {
      std::lock_guard<std::mutex> lock(mu_);
      if (urgent) {
        tasks_.push_front(std::move(task));
      } else {
        tasks_.push_back(std::move(task));
      }
    };
    return o;
  }

  // Runs the stage tasks queued now.
  void RunTasks() {
    while (true) {
      std::function<void()> task;
      {
        std::lock_guard<std::mutex> lock(mu_);
        if (tasks_.empty()) return;
        task = std::move(tasks_.front());
        tasks_.pop_front();
      }
      task();
    }
  }

  // Runs stage tasks as they come (post-processing is posted from an engine
  // thread when an inference ends) until `finished` or 10 s.
  template <typename F>
  bool Drive(F finished) {
    for (int i = 0; i < 10000 && !finished(); ++i) {
      RunTasks();
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    return finished();
  }

  // The result a callback sets, running stage tasks meanwhile (bounded: a
  // result that never comes fails the test instead of hanging it).
  VisionResult Await(std::promise<VisionResult>& got) {
    auto future = got.get_future();
    if (!Drive([&] { return future.wait_for(std::chrono::seconds(0)) == std::future_status::ready; })) {
      ADD_FAILURE() << "no result within 10 s";
      VisionResult none;
      none.status = Internal("no result");
      return none;
    }
    return future.get();
  }

  VisionRequest Red(VisionService& s) {
    auto m = s.Model("colour");
    EXPECT_TRUE(m.has_value()) << m.error().ToString();
    VisionRequest r;
    r.model = *m;
    r.image = image_;
    r.held_bytes = static_cast<int64_t>(image_.size());
    return r;
  }

  FakeClock clock_;
  std::unique_ptr<Engine> engine_;
  std::mutex mu_;
  std::deque<std::function<void()>> tasks_;
  const std::string image_ = SolidBmp(4, 4, 255, 0, 0);
};

TEST_F(VisionServiceTest, AnImageGoesThroughEveryStage) {
  VisionService s(engine_.get(), Options());
  std::promise<VisionResult> got;
  VisionCallback done = [&](VisionResult&& r) { got.set_value(std::move(r)); };
  ASSERT_TRUE(s.Submit(Red(s), done).ok());
  EXPECT_FALSE(done) << "an admitted image takes its callback";
  EXPECT_EQ(s.stats().in_flight, 1);
  VisionResult r = Await(got);
  ASSERT_TRUE(r.status.ok()) << r.status.ToString();
  ASSERT_EQ(r.classes.size(), 3u);
  EXPECT_EQ(r.classes[0].class_id, 0) << "red";
  EXPECT_NEAR(r.classes[0].confidence, 1.0f, 1e-6);
  EXPECT_NEAR(r.classes[1].confidence, 0.0f, 1e-6);
  EXPECT_TRUE(r.timed);
  EXPECT_EQ(r.timings.received_ns, 1'000'000'000) << "the service's clock";
  const VisionStats st = s.stats();
  EXPECT_EQ(st.requests, 1u);
  EXPECT_EQ(st.timed_images, 1u);
  EXPECT_EQ(st.in_flight, 0);
  EXPECT_EQ(st.in_flight_bytes, 0);
}

TEST_F(VisionServiceTest, AdmissionIsBoundedByCountAndRefusalsLeaveTheCallback) {
  VisionServiceOptions o = Options();
  o.queue_capacity = 2;
  VisionService s(engine_.get(), o);
  std::atomic<int> answers{0};
  for (int i = 0; i < 2; ++i) {
    VisionCallback done = [&](VisionResult&&) { answers.fetch_add(1); };
    ASSERT_TRUE(s.Submit(Red(s), done).ok());
  }
  VisionCallback third = [&](VisionResult&&) { answers.fetch_add(100); };
  Status refused = s.Submit(Red(s), third);
  EXPECT_EQ(refused.code(), StatusCode::kUnavailable);
  EXPECT_NE(refused.message().find("2 images for model 'colour' are already waiting"), std::string::npos)
      << refused.message();
  EXPECT_TRUE(third) << "a refused image leaves its callback with the caller";
  EXPECT_EQ(s.CheckAdmission("colour", 100).code(), StatusCode::kUnavailable) << "the same answer before the body";
  EXPECT_EQ(s.stats().rejected_overload, 2u);
  ASSERT_TRUE(Drive([&] { return answers.load() >= 2 && s.stats().in_flight == 0; }));
  EXPECT_EQ(answers.load(), 2) << "each admitted image is answered once; the refused one never";
  EXPECT_TRUE(s.CheckAdmission("colour", 100).ok());
}

// A client that sends its next image as soon as it has its answer finds the model's place free:
// the place is given back before the answer is handed on (the pipeline's count and the bytes
// after). At a capacity of one, the next image is admitted from inside the answer's callback.
TEST_F(VisionServiceTest, TheNextImageSentFromTheAnswerIsAdmitted) {
  VisionServiceOptions o = Options();
  o.queue_capacity = 1;
  VisionService s(engine_.get(), o);
  std::atomic<int> answers{0};
  Status next;
  VisionCallback second = [&](VisionResult&&) { answers.fetch_add(1); };
  VisionCallback first = [&](VisionResult&&) {
    answers.fetch_add(1);
    next = s.Submit(Red(s), second);
  };
  ASSERT_TRUE(s.Submit(Red(s), first).ok());
  ASSERT_TRUE(Drive([&] { return answers.load() >= 2 && s.stats().in_flight == 0; }));
  EXPECT_TRUE(next.ok()) << next.ToString();
  EXPECT_EQ(s.stats().rejected_overload, 0u);
  EXPECT_EQ(s.stats().in_flight_bytes, 0);
}

TEST_F(VisionServiceTest, ACheapModelIsNotRefusedBehindASlowOne) {
  // Three images of a slow model, each 1.5 s on the fake clock, then 50 of
  // a cheap one at once: each model is admitted by its own time per image
  // (one measure for every model would have let about 11 in: 5000 ms over
  // the 421 ms the slow images brought it to).
  ASSERT_TRUE(RegisterChannelMeans("slow").ok());
  VisionServiceOptions o = Options();
  o.request_timeout_ms = 5000;
  o.stage_threads = 1;  // the capacity's floor: 2, under the bound measured
  VisionService s(engine_.get(), o);
  auto slow = s.Model("slow");
  ASSERT_TRUE(slow.has_value());
  for (int i = 0; i < 3; ++i) {
    std::promise<VisionResult> got;
    VisionCallback done = [&](VisionResult&& r) { got.set_value(std::move(r)); };
    VisionRequest r = Red(s);
    r.model = *slow;
    ASSERT_TRUE(s.Submit(std::move(r), done).ok());
    clock_.AdvanceNs(1'500'000'000);
    ASSERT_TRUE(Await(got).status.ok());
  }
  std::atomic<int> answered{0};
  for (int i = 0; i < 50; ++i) {
    VisionCallback done = [&](VisionResult&& r) {
      EXPECT_TRUE(r.status.ok()) << r.status.ToString();
      answered.fetch_add(1);
    };
    Status st = s.Submit(Red(s), done);
    ASSERT_TRUE(st.ok()) << "classification " << i << ": " << st.ToString();
  }
  EXPECT_EQ(s.stats().rejected_overload, 0u);
  // The slow model keeps its own bound: 5000 ms over its time per image.
  int admitted = 0;
  for (int i = 0; i < 50; ++i) {
    VisionCallback done = [&](VisionResult&&) { answered.fetch_add(1); };
    VisionRequest r = Red(s);
    r.model = *slow;
    if (s.Submit(std::move(r), done).ok()) ++admitted;
  }
  EXPECT_GE(admitted, 5);
  EXPECT_LE(admitted, 15) << "about 5000 / 421 of the slow model's images";
  ASSERT_TRUE(Drive([&] { return answered.load() == 50 + admitted; }));
}

TEST_F(VisionServiceTest, CallersWithAnImageEachAreNotRefusedBelowTwoPerStageThread) {
  // Ten images of 9 s each on the fake clock against a 10 s budget: the
  // budget alone would let one in at a time. Four callers on two stage
  // threads, one image each, are all admitted; a fifth image is refused.
  // (The engine runs on the real clock and is given what is left of the
  // budget, 1 s: time enough for its worker on a loaded machine.)
  VisionServiceOptions o = Options();
  o.request_timeout_ms = 10'000;
  o.stage_threads = 2;
  VisionService s(engine_.get(), o);
  for (int i = 0; i < 10; ++i) {
    std::promise<VisionResult> got;
    VisionCallback done = [&](VisionResult&& r) { got.set_value(std::move(r)); };
    ASSERT_TRUE(s.Submit(Red(s), done).ok());
    clock_.AdvanceNs(9'000'000'000);
    ASSERT_TRUE(Await(got).status.ok());
  }
  std::atomic<int> answered{0};
  for (int i = 0; i < 4; ++i) {
    VisionCallback done = [&](VisionResult&&) { answered.fetch_add(1); };
    Status st = s.Submit(Red(s), done);
    ASSERT_TRUE(st.ok()) << "caller " << i << ": " << st.ToString();
  }
  VisionCallback fifth = [&](VisionResult&&) { answered.fetch_add(100); };
  Status refused = s.Submit(Red(s), fifth);
  EXPECT_EQ(refused.code(), StatusCode::kUnavailable) << refused.ToString();
  EXPECT_NE(refused.message().find("4 images for model 'colour' are already waiting"), std::string::npos)
      << refused.message();
  ASSERT_TRUE(Drive([&] { return answered.load() == 4 && s.stats().in_flight == 0; }));
}

TEST_F(VisionServiceTest, ALargeImageCountsAsManyAsItsPixels) {
  // Room for 8 images of the model's usual size (learnt from the images
  // admitted: 4 x 4 at first). An 8 x 8 image counts as 4 of them, the next
  // as 64 / 20.8 pixels (the usual size moved towards it), so two get in
  // (7.1) and the third (64 / 25.1 = 2.5 more) is refused, as is a usual one.
  VisionServiceOptions o = Options();
  o.queue_capacity = 8;
  VisionService s(engine_.get(), o);
  for (int i = 0; i < 3; ++i) {
    std::promise<VisionResult> got;
    VisionCallback done = [&](VisionResult&& r) { got.set_value(std::move(r)); };
    ASSERT_TRUE(s.Submit(Red(s), done).ok());
    ASSERT_TRUE(Await(got).status.ok());
  }
  const std::string large = SolidBmp(8, 8, 255, 0, 0);
  std::atomic<int> answered{0};
  auto submit = [&](const std::string& image) {
    VisionRequest r = Red(s);
    r.image = image;
    VisionCallback done = [&](VisionResult&&) { answered.fetch_add(1); };
    return s.Submit(std::move(r), done);
  };
  ASSERT_TRUE(submit(large).ok());
  ASSERT_TRUE(submit(large).ok());
  const Status refused = submit(large);
  EXPECT_EQ(refused.code(), StatusCode::kUnavailable);
  EXPECT_NE(refused.message().find("2 images for model 'colour' are already waiting (this one has 2.5 times"),
            std::string::npos)
      << refused.message();
  EXPECT_EQ(submit(image_).code(), StatusCode::kUnavailable) << "8 of 8 taken";
  ASSERT_TRUE(Drive([&] { return answered.load() == 2 && s.stats().in_flight == 0; }));
  for (int i = 0; i < 8; ++i) ASSERT_TRUE(submit(image_).ok()) << "usual image " << i;
  ASSERT_TRUE(Drive([&] { return answered.load() == 10; }));
}

// A burst is admitted whole but decoded only as fast as the model can take it: at most one image
// per stage lane and one batch per instance (the cores', and the wide one) begin at once, the rest
// waiting as their encoded files; each answer begins the next, and every image is answered once.
TEST_F(VisionServiceTest, ABurstIsDecodedOnlyAsTheModelCanTakeIt) {
  VisionServiceOptions o = Options();
  o.queue_capacity = 64;
  o.stage_threads = 1;  // one lane (the test's executor runs the tasks)
  VisionService s(engine_.get(), o);
  const int ahead = 1 + (1 + 1) * 1;  // one lane; colour: one instance (and room for a wide one), max_batch_size 1
  const int images = ahead + 3;
  std::atomic<int> answers{0}, ok{0};
  for (int i = 0; i < images; ++i) {
    VisionCallback done = [&](VisionResult&& r) {
      ok.fetch_add(r.status.ok() ? 1 : 0);
      answers.fetch_add(1);
    };
    ASSERT_TRUE(s.Submit(Red(s), done).ok()) << i;
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    EXPECT_EQ(static_cast<int>(tasks_.size()), ahead) << "decodings posted for a burst of " << images;
  }
  EXPECT_EQ(s.stats().in_flight, images) << "every image admitted";
  ASSERT_TRUE(Drive([&] { return answers.load() == images && s.stats().in_flight == 0; }));
  EXPECT_EQ(ok.load(), images);
  EXPECT_EQ(s.stats().requests, static_cast<uint64_t>(images));
}

// A model with more instances than the machine has cores is fed as many images as they can take
// (its batches may run on GPUs, or wait on I/O): the bound follows the model's instances.
TEST_F(VisionServiceTest, AModelOfManyInstancesIsFedAnImagePerInstance) {
  ModelConfig c;
  c.name = "many";
  c.max_batch_size = 1;
  c.instance_count = 8;
  c.inputs = {{.name = "image", .dtype = DataType::kFp32, .dims = {3, 4, 4}}};
  c.outputs = {{.name = "scores", .dtype = DataType::kFp32, .dims = {3}}};
  c.parameters = {{"quern.task", "classification"}};
  ASSERT_TRUE(engine_->RegisterModel(c, [] { return std::make_unique<ChannelMeans>(); }).ok());
  VisionServiceOptions o = Options();
  o.queue_capacity = 64;
  o.stage_threads = 1;
  VisionService s(engine_.get(), o);
  auto m = s.Model("many");
  ASSERT_TRUE(m.has_value()) << m.error().ToString();
  EXPECT_EQ((*m)->instances, 8);
  const int ahead = 1 + (8 + 1) * 1;
  std::atomic<int> answers{0};
  for (int i = 0; i < ahead + 2; ++i) {
    VisionRequest r = Red(s);
    r.model = *m;
    VisionCallback done = [&](VisionResult&&) { answers.fetch_add(1); };
    ASSERT_TRUE(s.Submit(r, done).ok()) << i;
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    EXPECT_EQ(static_cast<int>(tasks_.size()), ahead);
  }
  ASSERT_TRUE(Drive([&] { return answers.load() == ahead + 2 && s.stats().in_flight == 0; }));
}

// An image waiting to begin whose caller leaves, or whose timeout passes, holds no place: the next
// arrival answers it (CANCELLED, DEADLINE_EXCEEDED) before its turn, with nothing run for it.
TEST_F(VisionServiceTest, AWaitingImageWhoseCallerLeftOrTimeRanOutIsAnsweredBeforeItsTurn) {
  VisionServiceOptions o = Options();
  o.queue_capacity = 64;
  o.stage_threads = 1;
  o.request_timeout_ms = 1000;
  VisionService s(engine_.get(), o);
  const int ahead = 1 + (1 + 1) * 1;
  std::atomic<int> answers{0};
  for (int i = 0; i < ahead; ++i) {  // they fill the model's places (their tasks not run yet)
    VisionCallback done = [&](VisionResult&&) { answers.fetch_add(1); };
    ASSERT_TRUE(s.Submit(Red(s), done).ok());
  }
  std::promise<VisionResult> left, late;
  VisionRequest leaving = Red(s);
  leaving.cancel = std::make_shared<CancellationToken>();
  auto token = leaving.cancel;
  VisionCallback left_done = [&](VisionResult&& r) { left.set_value(std::move(r)); };
  ASSERT_TRUE(s.Submit(leaving, left_done).ok());
  VisionCallback late_done = [&](VisionResult&& r) { late.set_value(std::move(r)); };
  ASSERT_TRUE(s.Submit(Red(s), late_done).ok());  // waits; its timeout passes below
  token->Cancel();
  clock_.AdvanceNs(500'000'000);
  VisionCallback next = [&](VisionResult&&) { answers.fetch_add(1); };
  ASSERT_TRUE(s.Submit(Red(s), next).ok());  // the arrival that looks: one gone, one still in time
  auto f = left.get_future();
  ASSERT_EQ(f.wait_for(std::chrono::seconds(0)), std::future_status::ready) << "answered on the arrival";
  EXPECT_EQ(f.get().status.code(), StatusCode::kCancelled);
  EXPECT_EQ(s.stats().in_flight, ahead + 2);
  clock_.AdvanceNs(600'000'000);  // past the second one's timeout (1 s), not the last arrival's
  VisionCallback another = [&](VisionResult&&) { answers.fetch_add(1); };
  ASSERT_TRUE(s.Submit(Red(s), another).ok());
  auto g = late.get_future();
  ASSERT_EQ(g.wait_for(std::chrono::seconds(0)), std::future_status::ready);
  const VisionResult r = g.get();
  EXPECT_EQ(r.status.code(), StatusCode::kDeadlineExceeded);
  EXPECT_NE(r.status.message().find("waited 1100 ms for its model"), std::string::npos) << r.status.message();
  {
    std::lock_guard<std::mutex> lock(mu_);
    EXPECT_EQ(static_cast<int>(tasks_.size()), ahead) << "nothing begun for the two";
  }
  EXPECT_EQ(s.stats().dropped, 2u);
  ASSERT_TRUE(Drive([&] { return s.stats().in_flight == 0; }));
  EXPECT_EQ(answers.load(), ahead + 2);
}

TEST_F(VisionServiceTest, AdmissionIsBoundedByMemory) {
  VisionServiceOptions o = Options();
  // A 3x4x4 FP32 input is 192 bytes; the first image always gets in.
  o.max_in_flight_bytes = 300;
  VisionService s(engine_.get(), o);
  VisionCallback a = [](VisionResult&&) {};
  ASSERT_TRUE(s.Submit(Red(s), a).ok());
  VisionCallback b = [](VisionResult&&) {};
  Status refused = s.Submit(Red(s), b);
  EXPECT_EQ(refused.code(), StatusCode::kUnavailable);
  EXPECT_NE(refused.message().find("--vision-max-memory-mb"), std::string::npos) << refused.message();
  EXPECT_GT(s.stats().in_flight_bytes, 192);
  ASSERT_TRUE(Drive([&] { return s.stats().in_flight == 0; }));
  EXPECT_EQ(s.stats().in_flight_bytes, 0);
}

TEST_F(VisionServiceTest, AnImagePastItsTimeoutIsDroppedBeforeDecoding) {
  VisionServiceOptions o = Options();
  o.request_timeout_ms = 50;
  VisionService s(engine_.get(), o);
  std::promise<VisionResult> got;
  VisionCallback done = [&](VisionResult&& r) { got.set_value(std::move(r)); };
  ASSERT_TRUE(s.Submit(Red(s), done).ok());
  clock_.AdvanceNs(51'000'000);  // waited 51 ms for a stage thread
  VisionResult r = Await(got);
  EXPECT_EQ(r.status.code(), StatusCode::kDeadlineExceeded);
  EXPECT_NE(r.status.message().find("waited 51 ms before decoding"), std::string::npos) << r.status.message();
  EXPECT_EQ(r.timings.decode_ns, 0) << "never decoded";
  const VisionStats st = s.stats();
  EXPECT_EQ(st.dropped, 1u);
  EXPECT_EQ(st.failed, 1u) << "answered with an error";
  EXPECT_EQ(st.in_flight, 0) << "its admission is given back";
  EXPECT_EQ(engine_->GetStatistics("colour").value()[0].success.count, 0u) << "never inferred";
}

TEST_F(VisionServiceTest, AnImageWhoseCallerLeftIsDroppedUnanswered) {
  VisionService s(engine_.get(), Options());
  std::promise<VisionResult> got;
  VisionCallback done = [&](VisionResult&& r) { got.set_value(std::move(r)); };
  VisionRequest r = Red(s);
  r.cancel = std::make_shared<CancellationToken>();
  ASSERT_TRUE(s.Submit(r, done).ok());
  r.cancel->Cancel();
  VisionResult out = Await(got);
  EXPECT_EQ(out.status.code(), StatusCode::kCancelled);
  const VisionStats st = s.stats();
  EXPECT_EQ(st.dropped, 1u);
  EXPECT_EQ(st.failed, 0u) << "nobody reads the answer";
  EXPECT_EQ(st.in_flight, 0);
}

TEST_F(VisionServiceTest, UndecodableImagesFailWithTheDecodersReason) {
  VisionService s(engine_.get(), Options());
  std::promise<VisionResult> got;
  VisionCallback done = [&](VisionResult&& r) { got.set_value(std::move(r)); };
  VisionRequest r = Red(s);
  const std::string junk = "not an image at all";
  r.image = junk;
  ASSERT_TRUE(s.Submit(r, done).ok());
  VisionResult out = Await(got);
  EXPECT_EQ(out.status.code(), StatusCode::kInvalidArgument) << out.status.ToString();
  EXPECT_EQ(s.stats().failed, 1u);
}

// A model whose run ends past its deadline (as the engine reports it: the
// batch queue's drop, or a backend that stops at the deadline).
class PastItsDeadline : public Model {
 public:
  explicit PastItsDeadline(std::string message) : message_(std::move(message)) {}
  Status Execute(const std::vector<NamedTensor>&, int64_t, std::vector<NamedTensor>&) override {
    return DeadlineExceeded(message_);
  }

 private:
  std::string message_;
};

TEST_F(VisionServiceTest, AModelsMissedDeadlineNamesTheModelAndTheRequestTimeout) {
  // The engine's drop for the request's deadline, and a time limit of the model's own (its backend's
  // run time limit): only the first is the request timeout's doing.
  const std::tuple<std::string, std::string, std::string> cases[] = {
      {"late", "request deadline passed while queued",
       "model 'late': request deadline passed while queued (the request timeout is 1500 ms, --vision-timeout-ms)"},
      {"slow", "execute() ran longer than 50 ms (quern.execute_timeout_ms)",
       "model 'slow': execute() ran longer than 50 ms (quern.execute_timeout_ms)"},
  };
  for (const auto& [name, said, expected] : cases) {
    ModelConfig c;
    c.name = name;
    c.max_batch_size = 1;
    c.inputs = {{.name = "image", .dtype = DataType::kFp32, .dims = {3, 4, 4}}};
    c.outputs = {{.name = "scores", .dtype = DataType::kFp32, .dims = {3}}};
    c.parameters = {{"quern.task", "classification"}};
    ASSERT_TRUE(engine_->RegisterModel(c, [said] { return std::make_unique<PastItsDeadline>(said); }).ok());
    VisionServiceOptions o = Options();
    o.request_timeout_ms = 1500;
    VisionService s(engine_.get(), o);
    auto m = s.Model(name);
    ASSERT_TRUE(m.has_value()) << m.error().ToString();
    VisionRequest r = Red(s);
    r.model = *m;
    std::promise<VisionResult> got;
    VisionCallback done = [&](VisionResult&& res) { got.set_value(std::move(res)); };
    ASSERT_TRUE(s.Submit(r, done).ok());
    const VisionResult out = Await(got);
    EXPECT_EQ(out.status.code(), StatusCode::kDeadlineExceeded);
    EXPECT_EQ(out.status.message(), expected);
  }
}

TEST_F(VisionServiceTest, ModelsAreLookedUpAgainOnlyWhenTheEnginesModelsChange) {
  VisionService s(engine_.get(), Options());
  auto first = s.Model("colour");
  ASSERT_TRUE(first.has_value());
  EXPECT_EQ(s.Models(VisionTask::kClassification), std::vector<std::string>{"colour"});
  const uint64_t before = engine_->ModelsGeneration();
  auto again = s.Model("colour");
  ASSERT_TRUE(again.has_value());
  EXPECT_EQ(first->get(), again->get()) << "the same pipeline, nothing changed";
  // Another model comes: the lists know it at once.
  ASSERT_TRUE(RegisterChannelMeans("another").ok());
  EXPECT_GT(engine_->ModelsGeneration(), before);
  EXPECT_EQ(s.Models(VisionTask::kClassification), (std::vector<std::string>{"another", "colour"}));
  auto after = s.Model("colour");
  ASSERT_TRUE(after.has_value());
  EXPECT_EQ(first->get(), after->get()) << "its version is the same: its pipeline is kept";
  // Unloaded: no longer found.
  ASSERT_TRUE(engine_->UnloadModel("another").ok());
  EXPECT_FALSE(s.Model("another").has_value());
  EXPECT_EQ(s.Models(VisionTask::kClassification), std::vector<std::string>{"colour"});
}

// Takes an encoded image whole (BYTES "image" [1]) and answers its length,
// once `gate` opens: an OCR model's shape, holding its images as long as a
// test wants.
class HeldReader : public Model {
 public:
  explicit HeldReader(std::shared_future<void> gate) : gate_(std::move(gate)) {}
  Status Execute(const std::vector<NamedTensor>& inputs, int64_t, std::vector<NamedTensor>& outputs) override {
    gate_.wait();
    auto strings = inputs.at(0).tensor.Strings();
    if (!strings) return strings.error();
    outputs = {{"length", testing::Floats({1}, {static_cast<float>(strings->at(0).size())})}};
    return Status::Ok();
  }

 private:
  std::shared_future<void> gate_;
};

class EncodedImageTest : public VisionServiceTest {
 protected:
  void SetUp() override {
    VisionServiceTest::SetUp();
    ModelConfig c;
    c.name = "reader";
    c.max_batch_size = 0;
    c.instance_count = 1;
    c.inputs = {{.name = "image", .dtype = DataType::kBytes, .dims = {1}}};
    c.outputs = {{.name = "length", .dtype = DataType::kFp32, .dims = {1}}};
    std::shared_future<void> gate = open_.get_future().share();
    ASSERT_TRUE(engine_->RegisterModel(c, [gate] { return std::make_unique<HeldReader>(gate); }).ok());
  }
  void TearDown() override {
    if (!opened_) open_.set_value();
  }
  void Open() {
    opened_ = true;
    open_.set_value();
  }
  EncodedImageRequest Image(const std::string& bytes) {
    EncodedImageRequest r;
    r.model = "reader";
    r.image = bytes;
    r.held_bytes = 100;
    return r;
  }

  std::promise<void> open_;
  bool opened_ = false;
};

TEST_F(EncodedImageTest, AnImageItsModelDecodesIsAdmittedLikeEveryOther) {
  VisionServiceOptions o = Options();
  o.queue_capacity = 1;
  VisionService s(engine_.get(), o);
  std::promise<float> first;
  EncodedImageCallback done = [&](InferResponse&& r, const VisionTimings& t) {
    EXPECT_EQ(t.received_ns, 1'000'000'000) << "the service's clock";
    first.set_value(r.status.ok() ? r.outputs.at(0).tensor.values<float>()[0] : -1.0f);
  };
  ASSERT_TRUE(s.SubmitEncoded(Image(image_), done).ok());
  EXPECT_FALSE(done) << "an admitted image takes its callback";
  EXPECT_EQ(s.stats().in_flight, 1);
  // Past the capacity: refused at once, as an image for a detection model is.
  EncodedImageCallback second = [&](InferResponse&&, const VisionTimings&) { ADD_FAILURE() << "ran"; };
  Status refused = s.SubmitEncoded(Image(image_), second);
  EXPECT_EQ(refused.code(), StatusCode::kUnavailable);
  EXPECT_NE(refused.message().find("1 images for model 'reader' are already waiting"), std::string::npos)
      << refused.message();
  EXPECT_TRUE(second) << "a refused image leaves its callback with the caller";
  VisionCallback other = [](VisionResult&&) {};
  EXPECT_TRUE(s.Submit(Red(s), other).ok()) << "another model's image: its own capacity";
  EXPECT_EQ(s.stats().rejected_overload, 1u);
  Open();
  auto answer = first.get_future();
  ASSERT_EQ(answer.wait_for(std::chrono::seconds(10)), std::future_status::ready);
  EXPECT_EQ(answer.get(), static_cast<float>(image_.size())) << "the image sent whole";
  ASSERT_TRUE(Drive([&] { return s.stats().in_flight == 0; }));
  EXPECT_EQ(s.stats().in_flight_bytes, 0) << "its memory is given back";
  EXPECT_EQ(s.stats().requests, 2u) << "the encoded image and the other model's";
}

TEST_F(EncodedImageTest, TheNextImageSentFromTheAnswerIsAdmitted) {
  VisionServiceOptions o = Options();
  o.queue_capacity = 1;
  VisionService s(engine_.get(), o);
  std::promise<Status> next;
  EncodedImageCallback second = [](InferResponse&&, const VisionTimings&) {};
  EncodedImageCallback first = [&](InferResponse&&, const VisionTimings&) {
    next.set_value(s.SubmitEncoded(Image(image_), second));
  };
  ASSERT_TRUE(s.SubmitEncoded(Image(image_), first).ok());
  Open();
  auto admitted = next.get_future();
  ASSERT_EQ(admitted.wait_for(std::chrono::seconds(10)), std::future_status::ready);
  const Status st = admitted.get();
  EXPECT_TRUE(st.ok()) << st.ToString();
  ASSERT_TRUE(Drive([&] { return s.stats().in_flight == 0; }));
}

TEST_F(EncodedImageTest, ItsMemoryCountsTheImageDecoded) {
  VisionServiceOptions o = Options();
  o.max_in_flight_bytes = 10'000;
  VisionService s(engine_.get(), o);
  // A 4x4 BMP: 54 + 48 bytes encoded, 48 decoded (counted four times).
  EncodedImageCallback a = [](InferResponse&&, const VisionTimings&) {};
  ASSERT_TRUE(s.SubmitEncoded(Image(image_), a).ok());
  EXPECT_EQ(s.stats().in_flight_bytes, 100 + static_cast<int64_t>(image_.size()) + 4 * 48);
  // 40x40: 4800 bytes decoded, 19,200 charged: past the bound beside the first.
  const std::string large = SolidBmp(40, 40, 0, 255, 0);
  EncodedImageCallback b = [](InferResponse&&, const VisionTimings&) { ADD_FAILURE() << "ran"; };
  Status refused = s.SubmitEncoded(Image(large), b);
  EXPECT_EQ(refused.code(), StatusCode::kUnavailable);
  EXPECT_NE(refused.message().find("--vision-max-memory-mb"), std::string::npos) << refused.message();
  Open();
  ASSERT_TRUE(Drive([&] { return s.stats().in_flight == 0; }));
  EXPECT_EQ(s.stats().in_flight_bytes, 0);
}

TEST_F(EncodedImageTest, AnUnknownModelIsNotAnOverloadAndMeasuresNothing) {
  VisionService s(engine_.get(), Options());
  const double ms_per_image = s.stats().ms_per_image;
  for (int i = 0; i < 50; ++i) {
    EncodedImageRequest r = Image(image_);
    r.model = "nobody";
    EncodedImageCallback done = [](InferResponse&&, const VisionTimings&) { ADD_FAILURE() << "ran"; };
    Status st = s.SubmitEncoded(r, done);
    ASSERT_EQ(st.code(), StatusCode::kNotFound) << st.ToString();
    EXPECT_TRUE(done);
  }
  const VisionStats st = s.stats();
  EXPECT_EQ(st.rejected_overload, 0u);
  EXPECT_EQ(st.requests, 0u) << "never admitted";
  EXPECT_EQ(st.in_flight, 0);
  EXPECT_EQ(st.in_flight_bytes, 0);
  // (A refusal taken for an answered image would drive the time per image,
  // and with it the capacity's bound, to nothing.)
  EXPECT_EQ(st.ms_per_image, ms_per_image);
}

TEST_F(EncodedImageTest, AnImageOverThePixelLimitIsRefusedBeforeItsModel) {
  VisionServiceOptions o = Options();
  o.max_image_pixels = 100;  // 4x4 passes, 40x40 does not
  VisionService s(engine_.get(), o);
  EncodedImageCallback done = [](InferResponse&&, const VisionTimings&) { ADD_FAILURE() << "ran"; };
  Status st = s.SubmitEncoded(Image(SolidBmp(40, 40, 0, 0, 255)), done);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("40 x 40 pixels, over the limit of 100"), std::string::npos) << st.message();
  EXPECT_TRUE(done);
  EXPECT_EQ(s.stats().in_flight, 0);
  EXPECT_EQ(s.stats().in_flight_bytes, 0);
}

TEST(ParseMinConfidence, ReadsItTheWayCodeProjectAIDoes) {
  EXPECT_FLOAT_EQ(ParseMinConfidence("0.55"), 0.55f);
  EXPECT_FLOAT_EQ(ParseMinConfidence("  0.7\r\n"), 0.7f);  // whitespace around it
  EXPECT_FLOAT_EQ(ParseMinConfidence("1"), 1.0f);
  EXPECT_FLOAT_EQ(ParseMinConfidence(".25"), 0.25f);
  // Empty, not a number, or a number with something after it: the default, not an error.
  for (const char* v : {"", "   ", "abc", "0.5x", "0,5", "nan", "NaN", "0.5 0.6"}) {
    EXPECT_FLOAT_EQ(ParseMinConfidence(v), kDefaultMinConfidence) << "'" << v << "'";
  }
  // Out of range: below 0 counts as 0; above 1 stays (and keeps nothing).
  EXPECT_FLOAT_EQ(ParseMinConfidence("1.5"), 1.5f);
  EXPECT_FLOAT_EQ(ParseMinConfidence("-3"), 0.0f);
  EXPECT_GT(ParseMinConfidence("inf"), 1.0f);
  EXPECT_FLOAT_EQ(ParseMinConfidence("1e-3"), 0.001f);
  EXPECT_FLOAT_EQ(ParseMinConfidence(std::string(100, '0') + "1"), kDefaultMinConfidence);  // absurdly long
}

}  // namespace
}  // namespace quern
