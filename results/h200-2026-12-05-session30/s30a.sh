# plan for the next H200 session (issue 14, <= 9.5 minutes: each part has its timeout): the standard command with the "batch slots filled" column
# (b8effbb), then batch 32 with 8 requests a slot (a longer run: fill and drain weigh 1/8 of it, not 1/2), then the
# same queued at the gateway (--clients queued, e0d5c14: a server at capacity), so the 2.0x line's shortfall is
# split into the round's cost and the clients' turnover. Carry [".whl", ".gpu"] with this
# file copied to .gpu/; move results/ and checkpoints/ out first.
source .gpu/common.sh
R=$OUT/r; mkdir -p $R
snap() { mv $OUT/*.log $R/ 2>/dev/null; cp $OUT/parts.txt $R/ 2>/dev/null; tar czf $OUT/r.tgz -C $OUT r; }
part s64 150 python3 -m tandem bench speed --device cuda --random-config v2-lite --ks 0,3 --batches 1,32 --max-tokens 64 --requests-per-batch 2 --synthetic-acceptance 0.85 --synthetic-acceptance 0.92,0.72,0.36 --speculation fixed --in-process --out $R/s64; snap
part s64r8 150 python3 -m tandem bench speed --device cuda --random-config v2-lite --ks 0,3 --batches 32 --max-tokens 64 --requests-per-batch 8 --synthetic-acceptance 0.85 --speculation fixed --out $R/s64r8; snap
part s64q 270 python3 -m tandem bench speed --device cuda --random-config v2-lite --ks 0,3 --batches 32,1 --max-tokens 64 --requests-per-batch 8 --clients queued --synthetic-acceptance 0.85 --synthetic-acceptance 0.92,0.72,0.36 --speculation fixed --in-process --out $R/s64q; snap
grep "^|" $R/s64*.log | cut -d'|' -f2-9,20-23
cat $OUT/parts.txt
