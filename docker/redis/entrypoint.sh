#!/bin/sh
# Runs the command compose passes (`redis-server --appendonly yes ...`) as the
# redis user, in /data (where the AOF goes: Redis writes to its working directory).
set -eu

if [ "${1:-}" = "redis-server" ]; then
    # Started without a config file, Redis 7 refuses clients from other hosts
    # (protected mode); on the compose network every client is another host.
    case " $* " in
        *" --protected-mode "*) ;;
        *) set -- "$@" --protected-mode no ;;
    esac
fi

if [ "$(id -u)" = "0" ]; then
    # A volume mounted over /data may come with root's ownership.
    chown -R redis:redis /data
    exec setpriv --reuid=redis --regid=redis --init-groups "$@"
fi
exec "$@"
