// IEEE 754 binary16 (FP16) and binary32 conversions in plain C++, for
// tensors of FP16 elements (pre-processing writes them, post-processing and
// comparisons read them). Pure functions; any thread.
#pragma once

#include <cstdint>

namespace quern {

// binary16 from binary32, rounding to nearest even (NaN stays NaN,
// overflow becomes infinity).
uint16_t FloatToHalf(float f);

// binary32 from binary16 (exact).
float HalfToFloat(uint16_t h);

}  // namespace quern
