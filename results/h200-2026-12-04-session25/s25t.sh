# session 25, call T: issue 18's second edition, `tandem train --edition 2` (7.75 min schedule), held-out bits per
# byte of the export on the GPU, checkpoint back in <= 15 MB parts (the image's packages only: no wheels carried)
set +e
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false PYTHONPATH=$PWD
T0=$(date +%s); R=$OUT/r; mkdir -p $R
log() { echo "[$(( $(date +%s) - T0 ))s] $*" | tee -a $R/run.log; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >> $R/run.log
python3 -c "import torch, tokenizers, triton; print('torch', torch.__version__, 'tokenizers', tokenizers.__version__, 'triton', triton.__version__)" >> $R/run.log
log "1. corpus: unpack"; mkdir -p /tmp/c && tar xJf build/corpus/python-code.tar.xz -C /tmp/c; ls /tmp/c >> $R/run.log
log "2. train"
timeout -k 5 560 python3 -m tandem train --edition 2 --corpus /tmp/c/stdlib --extra /tmp/c/extra --compile true \
  --out build/ck/tandem-code-mini --work-dir /tmp/w >> $R/train.log 2>&1; echo "train rc=$?" | tee -a $R/run.log
grep -v "step \[\|step/s\|s/step" $R/train.log | tail -40 >> $R/run.log
log "3. held-out bits per byte of the export (GPU)"
timeout 30 python3 -c "from tandem.bench_heldout import main; main(['--model', 'build/ck/tandem-code-mini', '--corpus', '/tmp/c/stdlib', '--device', 'cuda'])" >> $R/run.log 2>&1
log "4. pack"
cp build/ck/tandem-code-mini/train_log.json $R/ 2>/dev/null
tar cf - -C build/ck tandem-code-mini | split -b 15000000 -d - $OUT/ck.tar.part-
tar czf $OUT/r.tgz -C $OUT r; ls -la $OUT; log done
