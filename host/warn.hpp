// The host layer's one-time warnings (internal): placement and topology problems that
// do not stop a run are reported once per distinct message.
#pragma once

#include <string>

namespace stepcore::numa::detail {

/// Prints "stepcore: warning: <message>" to stderr, once per distinct message.
void warn_once(const std::string& message);

}  // namespace stepcore::numa::detail
