"""The lab's own tests (`make lab-smoke`): its reports, statistics, router and provenance on made-up runs, and every
documented lab command run at a smoke size; vllm_engine/ holds the smokes that need vLLM's CPU engine."""
