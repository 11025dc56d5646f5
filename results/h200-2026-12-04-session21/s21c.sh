# session 21, call C: the step with dense_linear's copies (old layers.py) / without / and PDL; GPU tests; issue 14 lines
source .gpu/common.sh
R=$OUT/r; mkdir -p $R
cp models/layers.py /tmp/layers_new.py
cp .gpu/layers_old.py models/layers.py
part fp8copies 60 env TANDEM_PDL=0 python3 -m tandem bench fp8 --parts v2lite --out $R/fp8copies
cp /tmp/layers_new.py models/layers.py
part fp8nocopy 45 env TANDEM_PDL=0 python3 -m tandem bench fp8 --parts v2lite --out $R/fp8nocopy
part fp8pdl 45 python3 -m tandem bench fp8 --parts v2lite --out $R/fp8pdl
grep -A6 "^| weights" $R/fp8copies/fp8.md $R/fp8nocopy/fp8.md $R/fp8pdl/fp8.md | cut -c1-200
part gt 230 python3 -m pytest -q tests/test_gpu_pdl.py tests/test_fused_layer.py tests/test_gpu_graphs.py tests/test_gpu.py tests/test_gpu_fp8.py -k "not flashinfer"
tail -4 $OUT/gt.log
part speed 170 python3 -m tandem bench speed --device cuda --random-config v2-lite --ks 0,3 --batches 1,32 --max-tokens 64 --requests-per-batch 2 --synthetic-acceptance 0.85 --synthetic-acceptance 0.92,0.72,0.36 --in-process --out $R/speed
grep "^|" $R/speed/speed.md | cut -d'|' -f2-14,20-26
cp $OUT/*.log $OUT/*.txt $R/ 2>/dev/null; rm -f $OUT/*.log
tar czf $OUT/r.tgz -C $OUT r; rm -rf $R
cat $OUT/parts.txt
