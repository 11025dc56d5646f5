# plan for the next H200 session (not run in session 30: no device time left): batch 1 K = 3 served with every
# process's round functions timed (.gpu/site/sitecustomize.py, a probe, not Tandem), the target's two sends
# alternating round by round: the rows into the CUDA IPC ring before the next Propose, or after it (as Tandem
# does). .gpu/phases30.py prints both orders' medians.
# Copy into .gpu/: this file, phases30.py, sitecustomize30.py as .gpu/site/sitecustomize.py and session 27's
# sitecustomize27.py as .gpu/site/probe27.py (with common.sh).
source .gpu/common.sh
R=$OUT/r; mkdir -p $R
snap() { mv $OUT/*.log $R/ 2>/dev/null; cp $OUT/parts.txt $R/ 2>/dev/null; tar czf $OUT/r.tgz -C $OUT r; }
export TANDEM_PHASES_DIR=$R/ph TANDEM_ALTERNATE_ORDER=1 PYTHONPATH=$PWD/.gpu/site:$PYTHONPATH
part alt 150 python3 -m tandem bench speed --device cuda --random-config v2-lite --ks 3 --batches 1 --max-tokens 64 --requests-per-batch 8 --synthetic-acceptance 0.85 --speculation fixed --out $R/alt; snap
unset TANDEM_PHASES_DIR
python3 .gpu/phases30.py $R/ph | tee $R/phases.txt; snap
grep -h "^|" $R/alt/speed.md | cut -d'|' -f2-9
cat $OUT/parts.txt
