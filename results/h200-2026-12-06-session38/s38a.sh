# session 38, call A (one GPU, ideally nvidia-h200): the GPU tests at this tree (kernels/mla.py's padded reference, the
# ring-only early push), then issue 14's standard command with the 0.85 profile and the R1-like profile. ~560 s.
source .gpu/common.sh
R=$OUT/r; mkdir -p $R
snap() { mv $OUT/*.log $R/ 2>/dev/null; cp $OUT/parts.txt $OUT/gpu.txt $R/ 2>/dev/null; tar czf $OUT/r.tgz -C $OUT r; }
part gtest 240 python3 -m pytest -q -rfE -p no:cacheprovider tests/test_model_kernels.py tests/test_gpu.py tests/test_gpu_bridge.py tests/test_propose_ahead.py; snap
S="-m tandem bench speed --device cuda --random-config v2-lite --ks 0,3 --batches 1,32 --max-tokens 64 --requests-per-batch 3 --speculation fixed --in-process --repeats 2"
part c85 150 python3 $S --synthetic-acceptance 0.85 --out $R/c85; snap
part r1 150 python3 $S --synthetic-acceptance 0.92,0.72,0.36 --out $R/r1; snap
for t in c85 r1; do echo "== $t"; grep -h "^|" $R/$t/speed.md | cut -d'|' -f2-6,9-14,21-; done
cat $OUT/parts.txt
