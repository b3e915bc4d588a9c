// Printing a run's report: the text a learner reads, or one CSV or JSON record for scripts.
#pragma once

#include "runner.h"

namespace attn {

enum class OutputFormat { kText, kCsv, kJson };
void print_report(const RunReport& report, OutputFormat format);

}  // namespace attn
