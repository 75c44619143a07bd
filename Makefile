# Builds ./run (and faster variants), runs the tests and the benchmark.
CC ?= gcc
CFLAGS ?= -std=c11 -Wall -Wextra
PYTHON ?= python3
MODELS_DIR ?= ../shared/models
TOKENIZER_MODEL ?= $(MODELS_DIR)/tokenizer.model

.PHONY: all test bench clean

all: run

# -O3, no fast-math: summation order as written, output as llama2.c's `make run`
run: run.c
	$(CC) $(CFLAGS) -O3 -o $@ $< -lm

runfast: run.c
	$(CC) $(CFLAGS) -Ofast -o $@ $< -lm

runomp: run.c
	$(CC) $(CFLAGS) -Ofast -march=native -fopenmp -o $@ $< -lm

tests/.bin/unit: tests/unit.c run.c
	@mkdir -p tests/.bin
	$(CC) $(CFLAGS) -O2 -o $@ tests/unit.c -lm

test: run tests/.bin/unit
	MODELS_DIR=$(MODELS_DIR) PYTHON=$(PYTHON) RUN=./run bash tests/run_tests.sh

tokenizer.bin: $(TOKENIZER_MODEL) export.py
	$(PYTHON) export.py tokenizer $(TOKENIZER_MODEL) $@

clean:
	rm -rf run runfast runomp tests/.bin tests/.tmp build
