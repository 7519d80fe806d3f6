"""Generation defaults, each in one place: the paper's answer budgets and context, and the
sampling settings of Semantic Entropy's Nature code (shared by EigenScore)."""

SHORT_MAX_NEW_TOKENS = 32  # paper: 32 new tokens for short answers and GSM8K
SUMMARY_MAX_NEW_TOKENS = 384  # paper: 384 new tokens for summaries
CONTEXT_LENGTH = 4096  # paper: 4,096-token context

N_SAMPLES = 10  # Nature SE and EigenScore: 10 answers per prompt
SAMPLE_TEMPERATURE = 1.0  # Nature SE: T = 1.0
SAMPLE_TOP_P = 0.9  # Nature SE: nucleus 0.9
SAMPLE_TOP_K = 50  # the HF default the Nature runs inherited; 0 disables it

# `actmap serve` shutdown on SIGTERM (`actmap.serve.lifecycle`): readiness off while still serving
# (a load balancer's poll interval or two), then in-flight requests get at most the drain
# timeout; grace + drain stay under Kubernetes' default 30 s termination grace period
SHUTDOWN_GRACE_S = 2.0
DRAIN_TIMEOUT_S = 25.0
