# session 28's plan: the third edition, once T1-T3 brought it back (ck.tar.part-*), on this 2-core CPU, as the second
# edition's were evaluated (results/issue18/eval-cpu-e2c/eval-cpu.sh); held-out bits per byte came from the H200 run
# usage: bash eval-cpu-e3.sh DIR_WITH_PARTS
cd /work/main
mkdir -p /work/ck3 results/issue18/eval-cpu-e3 /tmp/c && cat "$1"/ck.tar.part-* | tar xf - -C /work/ck3
[ -d /tmp/c/stdlib ] || tar xJf build/corpus/python-code.tar.xz -C /tmp/c
M=/work/ck3/ck3; O=results/issue18
T0=$(date +%s); log() { echo "[$(( $(date +%s) - T0 ))s] $*"; }
log 0. held-out bits per byte, CPU; .venv/bin/python -m tandem bench heldout --model $M --corpus /tmp/c/stdlib --device cpu --out $O/eval-cpu-e3/heldout.json 2>&1 | tail -3
log 1. acceptance; .venv/bin/python -m tandem bench acceptance --model $M --max-k 3 --out $O/acceptance-e3-lineend 2>&1 | grep -v "INFO\|WARN" | tail -12
log 2. nextline; .venv/bin/python -m tandem bench nextline --model $M --docs 100 --out $O/nextline-e3 2>&1 | tail -12
log 3. steps; .venv/bin/python -m tandem bench steps --model $M --batches 1,8,32 --out $O/eval-cpu-e3/steps-cpu.json 2>&1 | tail -4
log 4. speed; .venv/bin/python -m tandem bench speed --model $M --ks 0,3 --batches 1,8,32 --max-tokens 64 --repeats 2 --out $O/eval-cpu-e3/speed 2>&1 | grep "^|" | head -10
log done
