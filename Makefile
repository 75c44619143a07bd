# Builds ./run (and faster variants), runs the tests and the benchmark.
# gcc unless CC is given (on the command line or in the environment): make's
# built-in default, cc, does not count
ifeq ($(origin CC),default)
CC = gcc
endif
CFLAGS ?= -std=c11 -Wall -Wextra
# added to every build's flags, e.g. EXTRA_CFLAGS=-march=armv8.2-a+dotprod
EXTRA_CFLAGS ?=
override CFLAGS += $(EXTRA_CFLAGS)
# the Windows cross-compiler for `make run.exe`
MINGW_CC ?= x86_64-w64-mingw32-gcc
PYTHON ?= python3
MODELS_DIR ?= ../shared/models
TOKENIZER_MODEL ?= $(MODELS_DIR)/tokenizer.model
# the binary `make test` checks: ./run, ./runfast or ./runomp
RUN ?= ./run
BENCH_RUNS ?= 5

.PHONY: all test bench bench-gguf bench-arch bench-moe-memory soak clean

# The first of $(PYTHON), python3 and /usr/bin/python3 that is a Python 3
# and runs the statement $(1) (an import), or nothing.
find_python = $(firstword $(foreach p,$(PYTHON) python3 /usr/bin/python3,$(shell $(p) -c 'import sys; assert sys.version_info >= (3, 6); $(1)' >/dev/null 2>&1 && echo $(p))))

# `make test` needs numpy (the reference implementations); `make
# tokenizer.bin` only Python 3. Each stops at once when there is none.
ifneq ($(filter test,$(MAKECMDGOALS)),)
TEST_PYTHON := $(call find_python,import numpy)
ifeq ($(TEST_PYTHON),)
$(error make test needs a Python 3 with numpy: apt-get install python3-numpy (or pip install numpy), or give one with PYTHON=/path/to/python3)
endif
endif
ifneq ($(filter tokenizer.bin,$(MAKECMDGOALS)),)
TOOL_PYTHON := $(call find_python,pass)
ifeq ($(TOOL_PYTHON),)
$(error make tokenizer.bin needs Python 3: apt-get install python3, or give one with PYTHON=/path/to/python3)
endif
endif

all: run

# -O3, no fast-math: summation order as written, output as llama2.c's `make run`
run: run.c
	$(CC) $(CFLAGS) -O3 -o $@ $< -lm

# -Ofast, but NaN and infinity stay what they are: -ffinite-math-only would
# let the compiler assume them away, and with them the checks that reject
# `-t nan` or a model whose activations overflow
FASTFLAGS = -Ofast -fno-finite-math-only

# the fast builds ask for the vector kernels that need no -march (RUN_SIMD:
# NEON on aarch64); `make run` never does
FASTFLAGS += -DRUN_SIMD

runfast: run.c
	$(CC) $(CFLAGS) $(FASTFLAGS) -o $@ $< -lm

# vector kernels for this machine's instruction set, threads over matrix rows;
# tuned generically: GCC 12 tunes an AMD Zen 5 as Zen 3, whose costs make it
# reload the kernels' inputs from memory in every multiply-add (half speed)
runomp: run.c
	$(CC) $(CFLAGS) $(FASTFLAGS) -march=native -mtune=generic -fopenmp -o $@ $< -lm

# Windows (MinGW-w64), as `make run`: byte-identical output
run.exe: run.c
	$(MINGW_CC) $(CFLAGS) -O3 -o $@ $< -lm

tests/.bin/unit: tests/unit.c run.c
	@mkdir -p tests/.bin
	$(CC) $(CFLAGS) -O2 -o $@ tests/unit.c -lm

# the Llama 3 test driver: tokenizer, chat template and logits (tests/test_llama3.py)
tests/.bin/llama3_dump: tests/llama3_dump.c tests/hex_lines.h run.c
	@mkdir -p tests/.bin
	$(CC) $(CFLAGS) -Wno-unused-function -O2 -o $@ tests/llama3_dump.c -lm

# the same built as ./runomp: GGUF logits through the vector kernels (tests/test_gguf.py)
tests/.bin/llama3_dump_native: tests/llama3_dump.c tests/hex_lines.h run.c
	@mkdir -p tests/.bin
	$(CC) $(CFLAGS) $(FASTFLAGS) -march=native -mtune=generic -fopenmp -Wno-unused-function -o $@ tests/llama3_dump.c -lm

# the JSON mask test driver: the tokens a schema allows after a text (tests/test_json_schema.py)
tests/.bin/json_mask_dump: tests/json_mask_dump.c tests/hex_lines.h run.c
	@mkdir -p tests/.bin
	$(CC) $(CFLAGS) -Wno-unused-function -O2 -o $@ tests/json_mask_dump.c -lm

# the GGUF vocabulary test driver: tokenizer, special ids and chat turns (tests/test_gguf_vocab.py)
tests/.bin/gguf_vocab_dump: tests/gguf_vocab_dump.c tests/hex_lines.h run.c
	@mkdir -p tests/.bin
	$(CC) $(CFLAGS) -Wno-unused-function -O2 -o $@ tests/gguf_vocab_dump.c -lm

# the same tests on the vector kernels and threads of ./runomp
tests/.bin/unit_native: tests/unit.c run.c
	@mkdir -p tests/.bin
	$(CC) $(CFLAGS) $(FASTFLAGS) -march=native -mtune=generic -fopenmp -o $@ tests/unit.c -lm

# the same tests on the AVX2 kernels, as ./runomp builds them on an x86-64
# machine with AVX2 but neither AVX-512 nor VNNI (the packed GGUF
# kernel's AVX2 form); x86-64 only, run where the machine has AVX2,
# FMA and F16C (tests/test_unit.sh)
UNIT_AVX2 = $(if $(filter x86_64 amd64,$(shell uname -m)),tests/.bin/unit_avx2 tests/.bin/unit_avxvnni)
tests/.bin/unit_avx2: tests/unit.c run.c
	@mkdir -p tests/.bin
	$(CC) $(CFLAGS) $(FASTFLAGS) -march=haswell -mtune=generic -fopenmp -o $@ tests/unit.c -lm

# and as an AVX2 machine's with AVX-VNNI (Intel's cores from Alder Lake on):
# the packed kernel's vpdpbusd form on 256-bit registers; run where the
# machine has avx_vnni
tests/.bin/unit_avxvnni: tests/unit.c run.c
	@mkdir -p tests/.bin
	$(CC) $(CFLAGS) $(FASTFLAGS) -march=haswell -mavxvnni -mtune=generic -fopenmp -o $@ tests/unit.c -lm

# Sanitizer builds (tests/test_sanitize.sh): AddressSanitizer with its leak
# checker, and UndefinedBehaviorSanitizer; every report is fatal
SANFLAGS = -fsanitize=address,undefined,float-cast-overflow -fno-sanitize-recover=all -fno-omit-frame-pointer -g -O1
SANITIZE_BINS = tests/.bin/run_asan $(if $(wildcard tests/unit.c),tests/.bin/unit_asan tests/.bin/unit_asan_native) tests/.bin/run_g

tests/.bin/run_asan: run.c
	@mkdir -p tests/.bin
	$(CC) $(CFLAGS) $(SANFLAGS) -o $@ run.c -lm

tests/.bin/unit_asan: tests/unit.c run.c
	@mkdir -p tests/.bin
	$(CC) $(CFLAGS) $(SANFLAGS) -o $@ tests/unit.c -lm

# the same on this machine's vector kernels (VNNI: the packed weights; no
# -fopenmp: the leak checker cannot stop threads at a fork)
tests/.bin/unit_asan_native: tests/unit.c run.c
	@mkdir -p tests/.bin
	$(CC) $(CFLAGS) $(SANFLAGS) -DRUN_SIMD -march=native -mtune=generic -o $@ tests/unit.c -lm

# for tests/test_valgrind.sh: debug info, no -march (valgrind has no AVX-512)
tests/.bin/run_g: run.c
	@mkdir -p tests/.bin
	$(CC) $(CFLAGS) -g -O2 -o $@ run.c -lm

# libFuzzer targets in tests/fuzz/ (clang): `make fuzz FUZZ_SECONDS=N` runs
# each for N seconds; fuzz-build says so and builds none where clang's
# libFuzzer does not link. FUZZ_SECONDS also reaches tests/test_fuzz.sh.
FUZZ_CC ?= clang
FUZZ_SECONDS ?= 5
export FUZZ_SECONDS
FUZZ_TARGETS = checkpoint tokenizer encode options generate batch http gguf schema
FUZZ_BINS = $(FUZZ_TARGETS:%=tests/.bin/fuzz_%)
FUZZ_FLAGS = -std=c11 -g -O1 -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined

tests/.bin/fuzz_%: tests/fuzz/fuzz_%.c tests/fuzz/fuzz_common.h tests/fuzz/encode_check.h run.c
	@mkdir -p tests/.bin
	$(FUZZ_CC) $(FUZZ_FLAGS) -I. -o $@ $< -lm

.PHONY: fuzz fuzz-build fuzz-bins clean-fuzz
fuzz-bins: $(FUZZ_BINS)
fuzz-build:
	@mkdir -p tests/.bin
	@if printf 'int LLVMFuzzerTestOneInput(const char *d, unsigned long n) { (void)d; (void)n; return 0; }\n' | \
	    $(FUZZ_CC) -fsanitize=fuzzer -x c - -o tests/.bin/fuzz_probe >/dev/null 2>&1; then \
	    $(MAKE) --no-print-directory fuzz-bins; \
	else echo "fuzz-build: '$(FUZZ_CC) -fsanitize=fuzzer' does not link here: fuzz targets not built"; fi

fuzz: fuzz-build
	MODELS_DIR=$(MODELS_DIR) bash tests/fuzz/run_fuzz.sh $(FUZZ_SECONDS) tests/fuzz/.out

clean: clean-fuzz
clean-fuzz:
	rm -rf tests/fuzz/.out

test: $(RUN) runomp build/bench/peak build/bench/bandwidth tests/.bin/unit tests/.bin/unit_native $(UNIT_AVX2) tests/.bin/llama3_dump tests/.bin/llama3_dump_native tests/.bin/gguf_vocab_dump tests/.bin/json_mask_dump $(SANITIZE_BINS) fuzz-build
	MODELS_DIR=$(MODELS_DIR) PYTHON=$(TEST_PYTHON) RUN=$(RUN) bash tests/run_tests.sh

# the streaming-read probe, then bench/bench.py with the fastest build; the
# random checkpoints are written once into build/bench
build/bench/bandwidth: bench/bandwidth.c
	@mkdir -p build/bench
	$(CC) $(CFLAGS) -O3 -march=native -fopenmp -o $@ $<

# the peak multiply-add rate and the matmul kernels' rate, built as ./runomp
build/bench/peak: bench/peak.c run.c
	@mkdir -p build/bench
	$(CC) $(CFLAGS) $(FASTFLAGS) -march=native -mtune=generic -fopenmp -o $@ bench/peak.c -lm

bench: runomp build/bench/bandwidth build/bench/peak
	MODELS_DIR=$(MODELS_DIR) RUN=./runomp $(PYTHON) bench/bench.py --runs $(BENCH_RUNS)
	MODELS_DIR=$(MODELS_DIR) RUN=./runomp $(PYTHON) bench/gguf.py --runs $(BENCH_RUNS)
	$(if $(LLAMA_CPP),RUN=./runomp $(PYTHON) bench/arch.py --runs $(BENCH_RUNS),@echo "bench: LLAMA_CPP not set: bench/arch.py skipped (bench/llamacpp.md)")

# the architectures beyond llama (Qwen3, Gemma 3 shapes) against today's
# llama.cpp (LLAMA_CPP: its build directory, bench/llamacpp.md)
bench-arch: runomp build/bench/bandwidth
	RUN=./runomp $(PYTHON) bench/arch.py --runs $(BENCH_RUNS)

# a mixture-of-experts model near the size of RAM: the full-depth
# Qwen3-30B-A3B shape in Q4_K_M (18.6 GB written once into build/bench/moe),
# its peak RSS against the file, and 16 requests' throughput against one
bench-moe-memory: runomp
	RUN=./runomp $(PYTHON) bench/moe_memory.py --runs $(BENCH_RUNS)

# GGUF files against llama.cpp's llama-bench (LLAMA_CPP: a llama.cpp build
# directory, outside this repository; without it run.c's figures alone)
bench-gguf: runomp build/bench/bandwidth
	MODELS_DIR=$(MODELS_DIR) RUN=./runomp $(PYTHON) bench/gguf.py --runs $(BENCH_RUNS)

# -m serve under mixed traffic for SOAK_SECONDS (bench/soak_serve.py)
SOAK_SECONDS ?= 600
soak: run
	MODELS_DIR=$(MODELS_DIR) RUN=./run $(PYTHON) bench/soak_serve.py --seconds $(SOAK_SECONDS)

tokenizer.bin: $(TOKENIZER_MODEL) export.py
	$(TOOL_PYTHON) export.py tokenizer $(TOKENIZER_MODEL) $@

clean:
	rm -rf run runfast runomp run.exe tests/.bin tests/.tmp build
