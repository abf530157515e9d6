# Warnings, sanitizers and clang's thread-safety analysis for ctxpool targets.
add_library(ctxpool_warnings INTERFACE)
target_compile_options(ctxpool_warnings INTERFACE
  -Wall -Wextra -Wno-unused-parameter -Wno-missing-field-initializers)
if(CMAKE_CXX_COMPILER_ID MATCHES "Clang")
  target_compile_options(ctxpool_warnings INTERFACE
    -Wthread-safety -Wthread-safety-beta -Wno-thread-safety-negative)
endif()
if(CTXPOOL_WERROR)
  target_compile_options(ctxpool_warnings INTERFACE -Werror)
endif()

if(CTXPOOL_SANITIZE)
  add_compile_options(-fsanitize=${CTXPOOL_SANITIZE} -fno-omit-frame-pointer
                      -fno-sanitize-recover=all)
  add_link_options(-fsanitize=${CTXPOOL_SANITIZE})
endif()
