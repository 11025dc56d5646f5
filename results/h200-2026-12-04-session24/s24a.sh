# session 24, call A: the draft uploads patch (tests + Propose old/new) + where batch-32 K=3's prefill goes + GPU tests
source .gpu/common.sh
R=$OUT/r; mkdir -p $R
snap() { mv $OUT/*.log $R/ 2>/dev/null; cp $OUT/parts.txt $OUT/gpu.txt $R/ 2>/dev/null; tar czf $OUT/r.tgz -C $OUT r; }
FILES="services/draft/engine.py services/draft/chain.py models/batch.py"
use() { for f in $FILES; do cp .gpu/t24a/$1/$f $f; done; }
use new
part gt 110 python3 -m pytest -q tests/test_draft_chain.py tests/test_gpu_graphs.py tests/test_lossless_rows.py -k "not flashinfer"; snap
part pf 130 python3 .gpu/pf24.py; snap
for t in head new; do use $t; part pw-${t}1 55 python3 .gpu/pw23.py ${t}1; snap; done
use new
grep -h "^==" $R/pw-*.log
part gt2 170 python3 -m pytest -q tests/test_gpu_prefill.py tests/test_prefill_kernels.py tests/test_fused_layer.py tests/test_gpu_dsa.py tests/test_dsa_kernels.py -k "not flashinfer"; snap
cat $OUT/parts.txt
