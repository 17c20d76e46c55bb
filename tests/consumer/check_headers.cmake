# The installed headers are the integrator's API and nothing else (cmake -P, or include()d
# by run.cmake with INCLUDE_DIR set): fails, naming the file, the line and the rule, when a
# header under INCLUDE_DIR/stepcore
#   - names a `detail` namespace or qualifier (internals live behind the library's boundary),
#   - names a scalar-preparation symbol (AdamWScalars, SignSgdScalars, prepare_*_scalars:
#     core/step_scalars.hpp),
#   - names the superaccumulator's digit arithmetic (deposit, deposit_double,
#     normalize_digits: core/superaccumulator.hpp),
#   - includes a quoted header that is not "stepcore/...", or one not installed beside it.
# Comments count: a public comment that names an internal is a leak too.
# Input (-D): INCLUDE_DIR, the install tree's include folder.
cmake_minimum_required(VERSION 3.25)

if(NOT INCLUDE_DIR OR NOT IS_DIRECTORY "${INCLUDE_DIR}/stepcore")
  message(FATAL_ERROR "check_headers: INCLUDE_DIR '${INCLUDE_DIR}' has no stepcore/ folder")
endif()

# <rule>|<regex>: one line of a header matching <regex> breaks <rule>.
set(_forbidden
  "a detail namespace or qualifier|(^|[^A-Za-z0-9_])detail[ \t]*(::|{)"
  "a detail namespace or qualifier|namespace[ \t]+([A-Za-z0-9_]+::)*detail([^A-Za-z0-9_]|$)"
  "a scalar-preparation symbol|(AdamW|SignSgd)Scalars"
  "a scalar-preparation symbol|prepare_[A-Za-z0-9_]*scalars"
  "the superaccumulator's digit arithmetic|normalize_digits"
  "the superaccumulator's digit arithmetic|(^|[^A-Za-z0-9_])deposit(_double)?[ \t]*\\(")

file(GLOB_RECURSE _headers RELATIVE "${INCLUDE_DIR}" "${INCLUDE_DIR}/stepcore/*")
list(SORT _headers)
set(_problems "")
foreach(h IN LISTS _headers)
  # One list element a line, whatever the line holds: the characters that a CMake list
  # treats specially (; [ ] \) stand in as <sc> <lb> <rb> <bs> until a line is reported.
  file(READ "${INCLUDE_DIR}/${h}" _text)
  string(REPLACE "\\" "<bs>" _text "${_text}")
  string(REPLACE ";" "<sc>" _text "${_text}")
  string(REPLACE "[" "<lb>" _text "${_text}")
  string(REPLACE "]" "<rb>" _text "${_text}")
  string(REPLACE "\n" ";" _lines "${_text}")
  set(_n 0)
  foreach(line IN LISTS _lines)
    math(EXPR _n "${_n} + 1")
    foreach(rule IN LISTS _forbidden)
      string(FIND "${rule}" "|" _bar)
      string(SUBSTRING "${rule}" 0 ${_bar} _what)
      math(EXPR _bar "${_bar} + 1")
      string(SUBSTRING "${rule}" ${_bar} -1 _regex)
      if(line MATCHES "${_regex}")
        string(STRIP "${line}" _shown)
        string(REPLACE "<sc>" ";" _shown "${_shown}")
        string(REPLACE "<lb>" "[" _shown "${_shown}")
        string(REPLACE "<rb>" "]" _shown "${_shown}")
        string(REPLACE "<bs>" "\\" _shown "${_shown}")
        string(APPEND _problems "\n  ${h}:${_n}: names ${_what}: ${_shown}")
        break()  # one report a line
      endif()
    endforeach()
    if(line MATCHES "^[ \t]*#[ \t]*include[ \t]*\"([^\"]*)\"")
      set(_inc "${CMAKE_MATCH_1}")
      if(NOT _inc MATCHES "^stepcore/")
        string(APPEND _problems "\n  ${h}:${_n}: includes \"${_inc}\", not a public header")
      elseif(NOT EXISTS "${INCLUDE_DIR}/${_inc}")
        string(APPEND _problems "\n  ${h}:${_n}: includes \"${_inc}\", which is not installed")
      endif()
    endif()
  endforeach()
endforeach()

list(LENGTH _headers _count)
if(_problems)
  message(FATAL_ERROR "check_headers: the installed headers expose internals (what an "
    "integrator does not call belongs behind the library's boundary, in core/ or the "
    "engines):${_problems}")
endif()
message(STATUS "check_headers: ${_count} installed headers, none names an internal")
