"""What the machine is and what the user asked of it, as values: the switches
(`snapshot.parse_env`, `EnvFlags`), the platform (`Platform`, `EnvSnapshot`), and parsers of
what the shell read (`procfs`: /proc texts; `cgroup`: the cgroup memory limit; `numa`: the
NUMA topology and sysfs texts). The lowest room: it imports no other."""
