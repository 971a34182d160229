from hpctrain.launch.requeue import job_to_requeue, requeue_decision


def test_array_task_is_requeued_alone():
    env = {"SLURM_JOB_ID": "107", "SLURM_ARRAY_JOB_ID": "100", "SLURM_ARRAY_TASK_ID": "7"}
    assert job_to_requeue(env) == "100_7"
    assert job_to_requeue({"SLURM_JOB_ID": "42"}) == "42"
    assert job_to_requeue({}) is None


def test_requeues_are_bounded():
    job, why = requeue_decision({"SLURM_JOB_ID": "42", "SLURM_RESTART_COUNT": "2"}, max_requeues=3)
    assert job == "42" and "restart 3 of at most 3" in why
    job, why = requeue_decision({"SLURM_JOB_ID": "42", "SLURM_RESTART_COUNT": "3"}, max_requeues=3)
    assert job is None and "cluster.max_requeues=3" in why and "resubmit" in why
    job, why = requeue_decision({}, max_requeues=3)
    assert job is None and "rerun the same command" in why
