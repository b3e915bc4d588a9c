# Compiles one chapter's kernels for sm_90 (sm_90a for the Hopper chapters: ARCH) the way the isa
# tests inspect them: the PTX that nvcc
# emits, a cubin with ptxas's resource report (registers, spills, stack), and the SASS of that
# cubin when cuobjdump exists. Called by tests/CMakeLists.txt with NVCC, CUOBJDUMP, SOURCE,
# CHAPTER_DIR, COMMON_DIR, NAMESPACE and OUT (the path prefix of the outputs).
if(NOT ARCH)
  set(ARCH sm_90)
endif()
set(flags -std=c++17 -arch=${ARCH} --expt-relaxed-constexpr -DCHAPTER_NAMESPACE=${NAMESPACE}
          -I${CHAPTER_DIR} -I${COMMON_DIR})
execute_process(COMMAND ${NVCC} ${flags} -ptx ${SOURCE} -o ${OUT}.ptx RESULT_VARIABLE status)
if(NOT status EQUAL 0)
  message(FATAL_ERROR "nvcc -ptx failed for ${CHAPTER_DIR}")
endif()
execute_process(COMMAND ${NVCC} ${flags} -cubin -Xptxas -v ${SOURCE} -o ${OUT}.cubin
                ERROR_FILE ${OUT}.ptxas.txt RESULT_VARIABLE status)
if(NOT status EQUAL 0)
  message(FATAL_ERROR "nvcc -cubin failed for ${CHAPTER_DIR}; see ${OUT}.ptxas.txt")
endif()
if(CUOBJDUMP)
  execute_process(COMMAND ${CUOBJDUMP} -sass ${OUT}.cubin OUTPUT_FILE ${OUT}.sass
                  RESULT_VARIABLE status)
  if(NOT status EQUAL 0)
    message(FATAL_ERROR "cuobjdump failed on ${OUT}.cubin")
  endif()
else()
  file(REMOVE ${OUT}.sass)
endif()
