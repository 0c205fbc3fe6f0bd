// Clang thread-safety annotations (-Wthread-safety): which mutex guards a
// member, which a function needs held. The build with clang checks them;
// other compilers see nothing.
#pragma once

#if defined(__clang__)
#define QUERN_THREAD_ANNOTATION_(x) __attribute__((x))
#else
#define QUERN_THREAD_ANNOTATION_(x)
#endif

#define QUERN_CAPABILITY(x) QUERN_THREAD_ANNOTATION_(capability(x))
#define QUERN_SCOPED_CAPABILITY QUERN_THREAD_ANNOTATION_(scoped_lockable)
#define QUERN_GUARDED_BY(x) QUERN_THREAD_ANNOTATION_(guarded_by(x))
#define QUERN_PT_GUARDED_BY(x) QUERN_THREAD_ANNOTATION_(pt_guarded_by(x))
#define QUERN_REQUIRES(...) QUERN_THREAD_ANNOTATION_(requires_capability(__VA_ARGS__))
#define QUERN_REQUIRES_SHARED(...) QUERN_THREAD_ANNOTATION_(requires_shared_capability(__VA_ARGS__))
#define QUERN_ACQUIRE(...) QUERN_THREAD_ANNOTATION_(acquire_capability(__VA_ARGS__))
#define QUERN_ACQUIRE_SHARED(...) QUERN_THREAD_ANNOTATION_(acquire_shared_capability(__VA_ARGS__))
#define QUERN_TRY_ACQUIRE(...) QUERN_THREAD_ANNOTATION_(try_acquire_capability(__VA_ARGS__))
#define QUERN_RELEASE(...) QUERN_THREAD_ANNOTATION_(release_capability(__VA_ARGS__))
#define QUERN_RELEASE_SHARED(...) QUERN_THREAD_ANNOTATION_(release_shared_capability(__VA_ARGS__))
#define QUERN_RELEASE_GENERIC(...) QUERN_THREAD_ANNOTATION_(release_generic_capability(__VA_ARGS__))
#define QUERN_EXCLUDES(...) QUERN_THREAD_ANNOTATION_(locks_excluded(__VA_ARGS__))
#define QUERN_ASSERT_HELD(x) QUERN_THREAD_ANNOTATION_(assert_capability(x))
#define QUERN_NO_THREAD_SAFETY_ANALYSIS QUERN_THREAD_ANNOTATION_(no_thread_safety_analysis)
