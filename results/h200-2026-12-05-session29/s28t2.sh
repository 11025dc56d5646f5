# session 28's plan, calls T2 and T3 (the same script twice): `tandem train --resume` for this call's 8.5 minutes; the
# machine of T1 must still be warm (build/w3/last.pt on it). Carry [".gpu", "build/corpus"]; results/, checkpoints/ out.
set +e
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
T0=$(date +%s); R=$OUT/r; mkdir -p $R
log() { echo "[$(( $(date +%s) - T0 ))s] $*" | tee -a $R/run.log; }
[ -f build/w3/last.pt ] || { log "no build/w3/last.pt: a fresh machine (T1's state is gone)"; tar czf $OUT/r.tgz -C $OUT r; exit 1; }
[ -d /tmp/c/extra ] || { mkdir -p /tmp/c; tar xJf build/corpus/python-code.tar.xz -C /tmp/c; }
log "train (resume; --edition 3 for the flags a resume takes from the command line: reserve, eval interval)"
timeout -k 5 530 python3 -m tandem train --edition 3 --resume build/w3/last.pt --out build/ck3 --work-dir build/w3 --compile true \
  --max-minutes 8.5 >> $R/train.log 2>&1; echo "train rc=$?" | tee -a $R/run.log
grep -v "step \[\|step/s\|s/step" $R/train.log | tail -30 >> $R/run.log
log "held-out bits per byte of the export (GPU)"
timeout 40 python3 -c "from tandem.bench_heldout import main; main(['--model', 'build/ck3', '--corpus', '/tmp/c/stdlib', '--device', 'cuda'])" >> $R/run.log 2>&1
cp build/ck3/train_log.json $R/ 2>/dev/null
tar cf - -C build ck3 | split -b 15000000 -d - $OUT/ck.tar.part-
tar czf $OUT/r.tgz -C $OUT r; ls -la $OUT; log done
