# Sourced by dev.sh, deploy/smoke-loadtest.sh and soak/ci-soak.sh:
#   ensure_adapter PYTHON   make sure wgpu finds a Vulkan, Metal or D3D12 adapter (a
#                           GPU, or Mesa's lavapipe), installing mesa-vulkan-drivers
#                           through apt when it finds none.
# An OpenGL adapter does not count: wgpu also offers Mesa's llvmpipe through OpenGL
# on machines with Mesa's EGL, and the kernels are built and tested on Vulkan (and
# Metal, D3D12), not on that backend, so a machine that only has it gets lavapipe too.

has_adapter() {
  XDG_RUNTIME_DIR="${XDG_RUNTIME_DIR:-/tmp}" "$1" - <<'PYEOF' 2>/dev/null
import sys, wgpu
ok = [a for a in wgpu.gpu.enumerate_adapters_sync() if str(a.info.get("backend_type", "")).lower() != "opengl"]
sys.exit(0 if ok else 1)
PYEOF
}

ensure_adapter() {
  local py="$1" sudo=""
  if has_adapter "$py"; then return 0; fi
  echo "no Vulkan/Metal/D3D12 wgpu adapter found; installing Mesa's software Vulkan driver (mesa-vulkan-drivers)" >&2
  if [ "$(id -u)" != 0 ]; then sudo="sudo"; fi
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq mesa-vulkan-drivers >/dev/null
  if ! has_adapter "$py"; then
    echo "still no Vulkan wgpu adapter after installing mesa-vulkan-drivers" >&2
    return 1
  fi
}
