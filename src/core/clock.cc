#include "quern/clock.h"

namespace quern {

const Clock& RealClockInstance() {
  static const RealClock* clock = new RealClock();
  return *clock;
}

}  // namespace quern
