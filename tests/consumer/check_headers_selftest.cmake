# ctest Package.HeaderCheckRefusesInternals (cmake -P): check_headers.cmake can fail. In a
# scratch include tree it must pass clean public headers, and fail, naming the rule, for
# each kind of leak written into one header in turn: a detail namespace or qualifier, a
# scalar-preparation symbol, the digit arithmetic, an internal or uninstalled include.
# Input (-D): WORK_DIR (scratch, emptied), CHECK (the path of check_headers.cmake).
cmake_minimum_required(VERSION 3.25)

set(inc "${WORK_DIR}/include")
file(REMOVE_RECURSE "${WORK_DIR}")
file(WRITE "${inc}/stepcore/version.hpp" "#pragma once\n")
file(WRITE "${inc}/stepcore/api.hpp"
  "// Public: integer deposits of every square; see the details below.\n#pragma once\n"
  "#include <cstdint>\n#include \"stepcore/version.hpp\"\nnamespace stepcore {\n"
  "struct NormPartial;\nvoid merge(NormPartial& a, const NormPartial& b) noexcept;\n}\n")

function(check expect rule)  # expect: pass | fail; rule: the text the failure must name
  execute_process(COMMAND ${CMAKE_COMMAND} -DINCLUDE_DIR=${inc} -P ${CHECK}
    RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out)
  if(expect STREQUAL "pass" AND NOT rc EQUAL 0)
    message(FATAL_ERROR "header check self-test: clean headers were refused:\n${out}")
  elseif(expect STREQUAL "fail")
    string(REGEX REPLACE "[ \n]+" " " flat "${out}")
    string(FIND "${flat}" "${rule}" at)
    if(rc EQUAL 0 OR at EQUAL -1)
      message(FATAL_ERROR "header check self-test: a header with ${rule} was not refused "
        "for it (${rc}):\n${out}")
    endif()
    message(STATUS "refused, as it must be: ${rule}")
  endif()
endfunction()

check(pass "")
# <what the message names>|<the header's offending text> (\n: a newline; <sc>, <lb>, <rb>:
# a semicolon and square brackets, which a CMake list cannot hold). The last case checks
# that lines are counted right past the characters CMake lists treat specially.
set(cases
  "names a detail namespace or qualifier|namespace stepcore::detail {\\n}\\n"
  "names a detail namespace or qualifier|namespace stepcore {\\nnamespace detail\\n{\\n}\\n}\\n"
  "names a detail namespace or qualifier|// the body is detail::finalize_partial\\n"
  "names a scalar-preparation symbol|struct AdamWScalars { float decay<sc> }<sc>\\n"
  "names a scalar-preparation symbol|void* p = (void*)&prepare_sign_sgd_scalars<sc>\\n"
  "names the superaccumulator's digit arithmetic|bool normalize_digits(unsigned long (&d)[20])<sc>\\n"
  "names the superaccumulator's digit arithmetic|inline void f(double x) { deposit_double(d, x)<sc> }\\n"
  "includes \"core/superaccumulator.hpp\", not a public header|#include \"core/superaccumulator.hpp\"\\n"
  "includes \"stepcore/detail/norm_finalize.hpp\", which is not installed|#include \"stepcore/detail/norm_finalize.hpp\"\\n"
  "leak.hpp:5: names a detail namespace or qualifier|// bits <lb>0, 32) of S<sc> a \\\\\\n\\n#define X(a) a<lb>0<rb> \\\\\\nnamespace detail {}\\n")
foreach(c IN LISTS cases)
  string(FIND "${c}" "|" bar)
  string(SUBSTRING "${c}" 0 ${bar} rule)
  math(EXPR bar "${bar} + 1")
  string(SUBSTRING "${c}" ${bar} -1 text)
  string(REPLACE "\\n" "\n" text "${text}")
  string(ASCII 59 semicolon)
  string(REPLACE "<sc>" "${semicolon}" text "${text}")
  string(REPLACE "<lb>" "[" text "${text}")
  string(REPLACE "<rb>" "]" text "${text}")
  file(WRITE "${inc}/stepcore/leak.hpp" "#pragma once\n${text}")
  check(fail "${rule}")
  file(REMOVE "${inc}/stepcore/leak.hpp")
endforeach()
check(pass "")
