// Whether this test binary runs under AddressSanitizer or ThreadSanitizer, for the checks
// their shadow memory and quarantines make meaningless (resident-set sizes). GCC defines
// __SANITIZE_ADDRESS__ / __SANITIZE_THREAD__; clang before 15 only answers __has_feature.
#pragma once

#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
#define STEPCORE_TEST_SANITIZED 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
#define STEPCORE_TEST_SANITIZED 1
#endif
#endif
#ifndef STEPCORE_TEST_SANITIZED
#define STEPCORE_TEST_SANITIZED 0
#endif
