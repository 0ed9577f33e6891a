# A two-stage batch pipeline: `make -f jobs/pipeline.mk` from the repository root.
#
# Each stage's target is its output's _SUCCESS file, which batchrun writes only when the stage is complete.
# Make reruns stage two only when stage one's _SUCCESS is newer than stage two's (or stage two never
# finished). A stage that was killed half way has no _SUCCESS: make runs it again and batchrun resumes it.
# A stage that is complete but out of date is started afresh (--no-resume), since its input changed.

BATCHRUN     ?= .venv/bin/batchrun
PIPELINE_OUT ?= out/pipeline
export PIPELINE_OUT

STAGE1 := $(PIPELINE_OUT)/answers/_SUCCESS
STAGE2 := $(PIPELINE_OUT)/followups/_SUCCESS

.PHONY: all clean
all: $(STAGE2)
	@echo "pipeline output: $(PIPELINE_OUT)/followups"

$(STAGE1): jobs/pipeline/stage1.yaml jobs/data/prompts.jsonl
	$(BATCHRUN) run jobs/pipeline/stage1.yaml $(if $(wildcard $@),--no-resume)

$(STAGE2): $(STAGE1) jobs/pipeline/stage2.yaml
	$(BATCHRUN) run jobs/pipeline/stage2.yaml $(if $(wildcard $@),--no-resume)

clean:
	rm -rf $(PIPELINE_OUT)
