

def test_parse_nvcc_ptxas_log():
    from bench import compile_check_cuda as cuda

    log = ("ptxas info    : Compiling entry function '_Z6kernelPf' for 'sm_90'\n"
           "ptxas info    : Function properties for _Z6kernelPf\n"
           "    16 bytes stack frame, 8 bytes spill stores, 4 bytes spill loads\n"
           "ptxas info    : Used 40 registers, used 1 barriers, 1024 bytes smem, 360 bytes cmem[0]\n"
           "ptxas info    : Compiling entry function '_Z1gv' for 'sm_90'\n"
           "ptxas info    : Used 8 registers, used 0 barriers, 352 bytes cmem[0]\n")
    assert cuda.parse_ptxas(log) == [
        {"name": "_Z6kernelPf", "arch": "sm_90", "regs": 40, "spills": 12, "smem": 1024},
        {"name": "_Z1gv", "arch": "sm_90", "regs": 8, "spills": 0, "smem": 0}]
