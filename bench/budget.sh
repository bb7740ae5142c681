# Sourced by the GPU benchmark scripts: one device call's time shared among its runs.
# Needs T0 (the script's start, epoch seconds), BUDGET (seconds for the whole script) and
# RUN_TIMEOUT (seconds for one run).
run_limit() {  # name, reserve, floor: prints the run's time limit; none (and says so) if
               # less than FLOOR seconds would be left after keeping RESERVE for the end
  local name=$1 reserve=$2 floor=$3
  local left=$(( BUDGET - ($(date +%s) - T0) - reserve ))
  if [ "$left" -lt "$floor" ]; then
    echo "$name: skipped (${left}s of the budget left)" >&2
    return 1
  fi
  echo $(( left < RUN_TIMEOUT ? left : RUN_TIMEOUT ))
}
