/* gradops' CANN C surface: what every aclnn operator header includes. */
#ifndef GRADOPS_CANN_ACLNN_BASE_H_
#define GRADOPS_CANN_ACLNN_BASE_H_

#include "aclnn/acl_meta.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Optional (CANN initialises on first use too): starts the Python interpreter that runs gradops now rather than
 * at the first operator call (a few seconds: torch's import). configPath is not read. */
ACL_FUNC_VISIBILITY aclnnStatus aclnnInit(const char *configPath);
ACL_FUNC_VISIBILITY aclnnStatus aclnnFinalize(void);

#ifdef __cplusplus
}
#endif

#endif /* GRADOPS_CANN_ACLNN_BASE_H_ */
