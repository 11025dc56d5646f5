source .gpu/common.sh
B="python3 -m tandem bench speed --device cuda --random-config v2-lite --speculation fixed,adaptive --ks 0,3 --batches 1,8,32 --max-tokens 64 --requests-per-batch 2 --repeats 2"
part zero 200 $B --synthetic-acceptance 0.02 --out /tmp/zero
part inproc 240 python3 -m tandem bench speed --device cuda --random-config v2-lite --synthetic-acceptance 0.85 --synthetic-acceptance 0.92,0.72,0.36 --ks 0,3 --batches 1,32 --max-tokens 64 --requests-per-batch 1 --in-process --out /tmp/inproc
tar czf $OUT/d.tgz -C /tmp zero inproc
grep "^|" /tmp/zero/speed.md /tmp/inproc/speed.md; cat $OUT/parts.txt
