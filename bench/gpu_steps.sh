# Sourced by the bench/run_*.sh scripts of a device call: bounded steps whose logs survive any stop.
# Needs OUT, LOGS (under OUT) and LIMIT (seconds for the whole call) set by the caller.
#   step SECONDS NAME CMD...   CMD bounded by SECONDS and by what is left of LIMIT (5 s kept for `pack`), its
#                              whole output in $LOGS/NAME.log, one line per step in $LOGS/summary.txt
#   show NAME LINES            the end of a step's log, warnings left out
# On exit every log (and the services' logs of a failed bench) is packed into $OUT/logs.tar.gz: one file
# comes back from the device however the call ended.
pack() { tar -czf "$OUT/logs.tar.gz" -C "$OUT" logs $(ls -d /tmp/bench_services-* 2>/dev/null) 2>/dev/null \
         && rm -rf "$LOGS"; echo "== $(date -u +%H:%M:%S) logs in $OUT/logs.tar.gz (${SECONDS}s)"; }
trap pack EXIT
step() { local t=$1 name=$2; shift 2; local left=$((LIMIT - SECONDS - 5))
         if [ "$left" -lt 20 ]; then echo "== skipped (time): $name" | tee -a "$LOGS/summary.txt"; return; fi
         [ "$t" -gt "$left" ] && t=$left
         echo "== $(date -u +%H:%M:%S) ${t}s: $name: $*" | tee -a "$LOGS/summary.txt"
         timeout "$t" "$@" > "$LOGS/$name.log" 2>&1; local rc=$?
         echo "== $name: exit $rc after ${SECONDS}s total" | tee -a "$LOGS/summary.txt"; }
show() { grep -v -i warn "$LOGS/$1.log" | tail -"$2"; }
