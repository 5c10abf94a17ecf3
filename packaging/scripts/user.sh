# The service user every Cortex unit runs as (User=cortex): a system account with no login, its
# home the state folder. Kept on removal (files under /var/lib/cortex stay its).
if ! getent group cortex >/dev/null; then
  groupadd --system cortex
fi
if ! getent passwd cortex >/dev/null; then
  useradd --system --gid cortex --home-dir /var/lib/cortex --no-create-home \
    --shell /usr/sbin/nologin --comment "Cortex LLM fleet" cortex
fi
