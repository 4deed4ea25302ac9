# Sourced by deploy/test-image.sh (its helpers, $IMAGE, $ROUTER_IMAGE, $SCRIPTS):
# the production docker-compose.yml itself, run by podman-compose with
# deploy/compose/lavapipe.yml over it (lavapipe, the images built above, no GPU to
# reserve), on a bridge network of its own where the dnsname CNI plugin resolves
# the service names (attnserve-0, attnserve-1 in deploy/nginx/compose/upstreams.conf):
#
#   1. the whole stack comes up: both replicas ready, the router in front on a
#      published loopback port; each container's health check passes (the image's
#      HEALTHCHECK, the router's curl check from docker-compose.yml); the logging
#      options are in force;
#   2. tests/image through the router: the API checks, pinning (the router's
#      access log is its container log), a stopped replica (`podman-compose stop`);
#   3. that replica started again restores, from its snapshot volume, the sessions
#      it held; tests/image/test_router_restart.py restarts a replica and finds its
#      sessions intact;
#   4. `podman-compose stop` ends every service cleanly, `down -v` removes the
#      containers, the network and the volumes.
#
# podman 4.3 cannot wait for `condition: service_healthy` (podman-compose says so
# and starts the router at once): the steps below wait for readiness themselves.

export COMPOSE_PROJECT_NAME="attnserve-citest"
export COMPOSE_FILE="docker-compose.yml:deploy/compose/lavapipe.yml"
export ATTNSERVE_IMAGE="$IMAGE" ATTNSERVE_ROUTER_IMAGE="$ROUTER_IMAGE" ATTNSERVE_BIND=127.0.0.1
ATTNSERVE_ROUTER_PORT="$(free_port)"
export ATTNSERVE_ROUTER_PORT
PODMAN_COMPOSE=("$SCRIPTS/podman-compose" --in-pod false)
compose() { "${PODMAN_COMPOSE[@]}" "$@" 9>&- 2> >(grep -v 'unable to get systemd connection' >&2); }
address() { podman inspect --format '{{range .NetworkSettings.Networks}}{{.IPAddress}}{{end}}' "$1"; }
C0="${COMPOSE_PROJECT_NAME}_attnserve-0_1"
C1="${COMPOSE_PROJECT_NAME}_attnserve-1_1"
CR="${COMPOSE_PROJECT_NAME}_router_1"
ROUTER_URL="http://127.0.0.1:$ATTNSERVE_ROUTER_PORT"

# ---------------------------------------------------------------------------
step "compose: podman-compose up ($COMPOSE_FILE)"
"${PODMAN_COMPOSE[@]}" --version | tr '\n' ' '; echo
compose down -v -t 10 >/dev/null 2>&1 || true  # what a killed run left
COMPOSE_UP=1
compose up -d --no-build >"$WORK/compose-up.log" 2>&1 \
  || { cat "$WORK/compose-up.log" >&2; die "podman-compose up failed"; }
grep -i 'warn' "$WORK/compose-up.log" | sed 's/^/  /' || true
CONTAINERS+=("$C0" "$C1" "$CR")
wait_ready "$C0" "http://$(address "$C0"):8421"
wait_ready "$C1" "http://$(address "$C1"):8421"
for i in $(seq 120); do
  "$PY" deploy/healthcheck.py "$ROUTER_URL/readyz" 2>/dev/null && break
  [ "$i" = 120 ] && die "the router did not answer /readyz on $ROUTER_URL"
  sleep 0.5
done
echo "router on $ROUTER_URL in front of attnserve-0 ($(address "$C0")) and attnserve-1 ($(address "$C1"))"
for c in "$C0" "$C1" "$CR"; do
  podman healthcheck run "$c" >/dev/null || die "the health check of $c failed"
  log="$(podman inspect --format '{{.HostConfig.LogConfig.Type}} max-size {{.HostConfig.LogConfig.Size}}' "$c")"
  echo "$c: health check passed; logs: $log"
  case "$log" in *"max-size 0B"|*"max-size ") die "$c: the logging max-size of docker-compose.yml is not in force";; esac
done

step "compose: tests/image through the router"
REPLICA_URLS="attnserve-0=http://$(address "$C0"):8421,attnserve-1=http://$(address "$C1"):8421"
ATTNSERVE_TEST_URL="$ROUTER_URL" ATTNSERVE_TEST_ADAPTER=llvmpipe ATTNSERVE_TEST_REPLICAS="$REPLICA_URLS" \
  ATTNSERVE_TEST_ROUTER_ACCESS_LOG="$(podman inspect --format '{{.HostConfig.LogConfig.Path}}' "$CR")" \
  ATTNSERVE_TEST_STOP_REPLICA="${PODMAN_COMPOSE[*]} stop {name}" \
  run_pytest tests/image/test_api_contract.py tests/image/test_router_contract.py
rc="$(podman container inspect --format '{{.State.ExitCode}}' "$C1")"
[ "$(podman container inspect --format '{{.State.Running}}' "$C1")" = false ] || die "$C1 still runs after the stop test"
[ "$rc" = 0 ] || [ "$rc" = 143 ] || die "$C1 exited with $rc on podman-compose stop"
echo "attnserve-1 was stopped by the tests, exit code $rc; $(podman logs "$C1" 2>&1 | grep -o '"msg":"snapshots written".*' | tail -n 1)"

step "compose: the stopped replica started again keeps its sessions"
compose start attnserve-1 >/dev/null
wait_ready "$C1" "http://$(address "$C1"):8421"
restored="$(podman logs "$C1" 2>&1 | grep '"msg":"snapshots restored"' | tail -n 1)"
echo "attnserve-1: $(echo "$restored" | grep -o '"msg":"snapshots restored".*')"
echo "$restored" | grep -Eq '"ok":[1-9]' || die "attnserve-1 restored no session from its snapshot volume"
# A restarted container may get a new address; nginx resolves the names when it (re)loads.
podman exec "$CR" nginx -s reload
ATTNSERVE_TEST_URL="$ROUTER_URL" ATTNSERVE_TEST_REPLICAS="$REPLICA_URLS" \
  ATTNSERVE_TEST_RESTART_REPLICA="sh -c '\"\$0\" --in-pod false restart \"\$1\" && podman exec \"\$2\" nginx -s reload' $SCRIPTS/podman-compose {name} $CR" \
  run_pytest -s tests/image/test_router_restart.py

step "compose: stop and down"
compose stop >/dev/null
for c in "$C0" "$C1"; do
  rc="$(podman container inspect --format '{{.State.ExitCode}}' "$c")"
  echo "$c stopped, exit code $rc"
  [ "$rc" = 0 ] || [ "$rc" = 143 ] || die "$c exited with $rc on podman-compose stop"
done
compose down -v -t 10 >/dev/null
COMPOSE_UP=""
left="$(podman ps -aq --filter "label=io.podman.compose.project=$COMPOSE_PROJECT_NAME")"
[ -z "$left" ] || die "podman-compose down left containers: $left"
! podman volume exists "${COMPOSE_PROJECT_NAME}_snapshots-0" || die "podman-compose down -v left the volumes"
echo "podman-compose down -v: containers, network and volumes removed"
