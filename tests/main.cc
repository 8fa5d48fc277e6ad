// The tests' main: tally's start-up call, then GoogleTest's.
#include <gtest/gtest.h>

#include "ops/install.h"

int main(int argc, char** argv) {
  tally::ops::install();
  testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
