# session 28's plan, call T1 of 3 (issue 18, the third edition): the grouped experts' GPU tests (failing: dense), then
# `tandem train --edition 3` for this call's 6 minutes (the schedule, 14 minutes less the first compile, spans T1-T3 with
# --resume: the machine must stay warm between calls, build/w3 is on it). Carry [".whl", ".gpu", "build/corpus"]
# (the tests' conftest needs the wheels and the protobuf stubs: common.sh); move results/ and checkpoints/ out first.
source .gpu/common.sh
export TOKENIZERS_PARALLELISM=true          # common.sh turns it off (for the services); the corpus' tokenizing wants it
T0=$(date +%s); R=$OUT/r; mkdir -p $R
log() { echo "[$(( $(date +%s) - T0 ))s] $*" | tee -a $R/run.log; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >> $R/run.log
log "1. corpus: unpack"; mkdir -p /tmp/c && tar xJf build/corpus/python-code.tar.xz -C /tmp/c
log "2. GPU tests of the grouped experts"; MOE=grouped
timeout 150 python3 -m pytest -q tests/test_gpu_train.py >> $R/run.log 2>&1 || { MOE=dense; log "failed: --moe dense"; }
log "3. train (T1)"
timeout -k 5 380 python3 -m tandem train --edition 3 --moe $MOE --corpus /tmp/c/stdlib --extra /tmp/c/extra --compile true \
  --out build/ck3 --work-dir build/w3 --max-minutes 6.0 >> $R/train.log 2>&1; echo "train rc=$?" | tee -a $R/run.log
grep -v "step \[\|step/s\|s/step" $R/train.log | tail -30 >> $R/run.log
log "4. pack"; cp build/ck3/train_log.json $R/ 2>/dev/null
tar cf - -C build ck3 | split -b 15000000 -d - $OUT/ck.tar.part-
tar czf $OUT/r.tgz -C $OUT r; ls -la $OUT; log done
